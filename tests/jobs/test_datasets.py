"""A user's own data: JSONL, Parquet and ``datasets`` datasets on local disk, with prompt and answer
fields chosen by name, a held-out eval split, and prompts over the token limit dropped and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onpolicy.jobs.dataset import DatasetError, Problem, load_splits
from onpolicy.jobs.prompts import prepare
from onpolicy.jobs.spec import DatasetSpec, SpecError, parse_spec
from onpolicy.models.registry import load_tokenizer

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "extra": i} for i in range(12)]
EVAL = [{"question": f"What is {i} * 3?", "solution": str(3 * i), "extra": i} for i in range(5)]
FIELDS = {"prompt_field": "question", "answer_field": "solution"}
EXPECTED = [Problem(r["question"], r["solution"]) for r in ROWS]
EXPECTED_EVAL = [Problem(r["question"], r["solution"]) for r in EVAL]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_files_with_named_fields_and_an_eval_file(tmp_path: Path, kind: str) -> None:
    write = write_jsonl if kind == "jsonl" else write_parquet
    train, held = write(tmp_path / f"train.{kind}", ROWS), write(tmp_path / f"eval.{kind}", EVAL)
    splits = load_splits(DatasetSpec(kind=kind, path=str(train), eval_path=str(held), **FIELDS))
    assert splits.train == EXPECTED and splits.eval == EXPECTED_EVAL
    capped = load_splits(DatasetSpec(kind=kind, path=str(train), eval_path=str(held), eval_size=2, **FIELDS))
    assert capped.eval == EXPECTED_EVAL[:2]


def test_an_hf_dataset_saved_to_disk_with_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    where = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(EVAL)}).save_to_disk(str(where))
    splits = load_splits(DatasetSpec(kind="hf", path=str(where), eval_split="test", **FIELDS))
    assert splits.train == EXPECTED and splits.eval == EXPECTED_EVAL
    with pytest.raises(DatasetError, match="no split 'validation'"):
        load_splits(DatasetSpec(kind="hf", path=str(where), split="validation", **FIELDS))


def test_a_missing_field_names_the_fields_there_are(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", ROWS)
    with pytest.raises(DatasetError, match="prompt"):
        load_splits(DatasetSpec(kind="parquet", path=str(path)))
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"no field 'prompt' \(fields: extra, question, solution\)"):
        load_splits(DatasetSpec(kind="jsonl", path=str(path)))


def test_arithmetic_eval_problems_are_held_out() -> None:
    splits = load_splits(DatasetSpec(size=64, max_operand=9, eval_size=32))
    assert len(splits.eval) == 32 and not {p.prompt for p in splits.eval} & {p.prompt for p in splits.train}
    with pytest.raises(DatasetError, match="cannot hold out"):
        load_splits(DatasetSpec(size=600, max_operand=9, eval_size=400))  # only 300 distinct problems


def test_eval_needs_a_split_and_split_fields_need_their_kind() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"model": "tiny-qwen3", "eval": {"interval": 2}})
    assert [f for f, _ in e.value.violations] == ["eval.interval"]
    with pytest.raises(SpecError) as e:
        parse_spec({"model": "tiny-qwen3", "dataset": {"kind": "jsonl", "path": "x", "eval_split": "test"}})
    assert [f for f, _ in e.value.violations] == ["dataset.eval_split"]


def test_long_prompts_are_dropped_and_counted() -> None:
    tok = load_tokenizer("tiny-qwen3")
    problems = [Problem("x" * n, "0") for n in (1, 10, 100, 1000)]
    templated = [len(tok.encode(tok.chat_prompt(p.prompt))) for p in problems]
    limit = templated[2]  # keeps the first three
    prepared = prepare(problems, tok, True, limit)
    assert [p.problem for p in prepared.prompts] == problems[:3] and prepared.dropped == 1
    assert [len(p.ids) for p in prepared.prompts] == templated[:3]
    assert "3 of 4 prompts kept, 1 longer than rollout.max_prompt_tokens" in prepared.summary("dataset", limit)
    raw = prepare(problems, tok, False, 1000)
    assert [list(p.ids) for p in raw.prompts] == [tok.encode(p.prompt) for p in problems]
    with pytest.raises(DatasetError, match="every one of its 4 prompts is longer"):
        prepare(problems, tok, True, 2)


def test_plot_series_take_step_events_and_eval_events() -> None:
    from onpolicy.jobs.plots import series

    events = [{"step": 0, "weight_version": 0, "eval_accuracy": 0.25, "message": "eval before training"},
              {"step": 1, "weight_version": 1, "reward_mean": 0.5, "loss": 0.1, "eval_accuracy": None},
              {"step": 1, "weight_version": 2, "reward_mean": 0.7, "loss": 0.2},  # a redone step: the last counts
              {"step": 2, "weight_version": 3, "reward_mean": 0.9, "eval_accuracy": 0.5}]
    got = series(events)
    assert got["reward_mean"] == [(1, 0.7), (2, 0.9)] and got["eval_accuracy"] == [(0, 0.25), (2, 0.5)]
    assert "loss" in got and got["loss"] == [(1, 0.2)]
