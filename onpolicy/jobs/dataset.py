"""Prompt/answer datasets: the built-in generated arithmetic task, JSONL and Parquet files, and
``datasets`` datasets on local disk, each with its held-out eval split.

``load_splits`` reads a job's training problems and its eval problems (empty without an eval split).
The prompt and answer are the record fields the spec names (``prompt_field``, ``answer_field``);
answers are kept as text. A JSONL file is streamed a line at a time, each line at most
``MAX_JSONL_LINE_BYTES``, so a huge or sparse file is refused at its first long line rather than read
whole. Nothing here downloads: an ``hf`` dataset is a ``save_to_disk`` directory
or a hub dataset already in the local Hugging Face cache, read with ``HF_DATASETS_OFFLINE``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import DatasetSpec


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class Splits:
    train: list[Problem]
    eval: list[Problem]


class DatasetError(ValueError):
    pass


def arithmetic(size: int, max_operand: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(["+", "-", "*"])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Problem(f"What is {a} {op} {b}? Answer with just the number.", str(value)))
    return out


def arithmetic_held_out(train: list[Problem], size: int, max_operand: int, seed: int) -> list[Problem]:
    """``size`` generated problems none of which is a training problem (``DatasetError`` when the
    operand range has too few others)."""
    seen = {p.prompt for p in train}
    rng_seed, out = seed, []
    for _ in range(64):
        rng_seed = rng_seed * 6364136223846793005 + 1442695040888963407 & (1 << 63) - 1
        for p in arithmetic(4 * size, max_operand, rng_seed):
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
                if len(out) == size:
                    return out
    raise DatasetError(f"dataset: cannot hold out {size} arithmetic problems besides the training ones "
                       f"(raise max_operand or lower eval_size)")


def _problem(record: Mapping[str, Any], spec: DatasetSpec, where: str) -> Problem:
    for name in (spec.prompt_field, spec.answer_field):
        if name not in record:
            fields = ", ".join(sorted(map(str, record))) or "none"
            raise DatasetError(f"{where}: no field {name!r} (fields: {fields}); set dataset.prompt_field / "
                               "answer_field")
    prompt, answer = record[spec.prompt_field], record[spec.answer_field]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: {spec.prompt_field!r} is {type(prompt).__name__}, not text")
    if answer is None:
        raise DatasetError(f"{where}: {spec.answer_field!r} is empty")
    return Problem(prompt, answer if isinstance(answer, str) else json.dumps(answer))


def _file(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {path}: no such file")
    return p


#: The longest JSONL record accepted (a longer line is refused, never read whole into memory).
MAX_JSONL_LINE_BYTES = 4 << 20


def _jsonl_lines(path: str, p: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line, read one bounded line at a time."""
    try:
        with open(p, "rb") as f:
            n = 0
            while line := f.readline(MAX_JSONL_LINE_BYTES + 1):
                n += 1
                if len(line) > MAX_JSONL_LINE_BYTES:
                    raise DatasetError(f"dataset {path}:{n}: line longer than {MAX_JSONL_LINE_BYTES >> 20} MiB")
                try:
                    yield n, line.decode("utf-8")
                except UnicodeDecodeError:
                    raise DatasetError(f"dataset {path}:{n}: not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(f"dataset {path}: unreadable ({e.strerror or e})") from None


def read_jsonl(path: str, spec: DatasetSpec) -> list[Problem]:
    """One problem per non-blank line, streamed (each line at most ``MAX_JSONL_LINE_BYTES``)."""
    p = _file(path)
    out = []
    for n, line in _jsonl_lines(path, p):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"dataset {path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise DatasetError(f"dataset {path}:{n}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"dataset {path}:{n}: expected a JSON object")
        out.append(_problem(obj, spec, f"dataset {path}:{n}"))
    return out


def read_parquet(path: str, spec: DatasetSpec) -> list[Problem]:
    p = _file(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("dataset kind parquet needs pyarrow (pip install 'onpolicy[data]')") from None
    try:
        table = pq.read_table(p, columns=sorted({spec.prompt_field, spec.answer_field}))
    except Exception as e:  # pyarrow raises ArrowInvalid, KeyError-like errors for missing columns, ...
        raise DatasetError(f"dataset {path}: not a readable Parquet file with columns {spec.prompt_field!r}, "
                           f"{spec.answer_field!r} ({str(e).splitlines()[0]})") from None
    return [_problem(row, spec, f"dataset {path} row {i}") for i, row in enumerate(table.to_pylist())]


def read_hf(path: str, split: str, spec: DatasetSpec) -> list[Problem]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DatasetError("dataset kind hf needs the datasets package (pip install 'onpolicy[data]')") from None
    try:
        loaded = datasets.load_from_disk(path) if Path(path).is_dir() else datasets.load_dataset(path, split=split)
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError offline, ...)
        raise DatasetError(f"dataset {path}: not a dataset on local disk or in the Hugging Face cache "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"dataset {path}: no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return [_problem(row, spec, f"dataset {path}[{split}] row {i}") for i, row in enumerate(loaded)]


def _nonempty(problems: list[Problem], what: str) -> list[Problem]:
    if not problems:
        raise DatasetError(f"{what}: no problems")
    return problems


def load_splits(spec: DatasetSpec) -> Splits:
    """The training problems and the held-out eval problems (``DatasetError`` naming the file,
    line or row of anything unreadable)."""
    if spec.kind == "arithmetic":
        train = arithmetic(spec.size, spec.max_operand, spec.seed)
        held = arithmetic_held_out(train, spec.eval_size, spec.max_operand, spec.seed) if spec.eval_size else []
        return Splits(train, held)
    if spec.kind == "hf":
        train = read_hf(spec.path, spec.split, spec)
        held = read_hf(spec.path, spec.eval_split, spec) if spec.eval_split else []
    else:
        read = read_jsonl if spec.kind == "jsonl" else read_parquet
        train = read(spec.path, spec)
        held = read(spec.eval_path, spec) if spec.eval_path else []
    if spec.eval_size:
        held = held[:spec.eval_size]
    if spec.has_eval:
        _nonempty(held, f"dataset {spec.eval_path or spec.path} (eval)")
    return Splits(_nonempty(train, f"dataset {spec.path}"), held)


def load_dataset(spec: DatasetSpec) -> list[Problem]:
    """The training problems."""
    return load_splits(spec).train


def batch_at(problems: list[Problem], cursor: int, count: int) -> list[Problem]:
    """``count`` problems starting at ``cursor``, wrapping around (the data cursor is ``step * count``)."""
    return [problems[(cursor + i) % len(problems)] for i in range(count)]
