"""Corrupt config, sample, dataset, weight and controller-state files give clear errors naming the
file — never a traceback, never a silent use of bad data. (Corrupt checkpoints:
tests/trainer/test_trainer_engine.py and test_restore_checkpoint_rpc.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from onpolicy.cli.main import main
from onpolicy.jobs.dataset import DatasetError, load_dataset
from onpolicy.jobs.spec import DatasetSpec, parse_spec
from onpolicy.services.common.errors import InvalidArgument
from onpolicy.services.common.weights import load_weight_version
from onpolicy.services.controller.records import JobEvent, JobRecord, JobState
from onpolicy.services.controller.store import JobStore
from onpolicy.weights import export_weights


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_corrupt_job_spec_and_sample_files(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("model: [tiny\n  steps: : :\n")
    assert "not valid YAML" in one_line_error(["submit", str(spec), "--address", "127.0.0.1:1"], capsys)
    spec.write_bytes(b"\xff\xfe\x00garbage")
    assert str(spec) in one_line_error(["submit", str(spec), "--address", "127.0.0.1:1"], capsys)
    sample = tmp_path / "sample.json"
    for content in (b'{"prompt_ids": [1, 2', b"\x00\xff", b'{"unexpected": true}'):
        sample.write_bytes(content)
        assert str(sample) in one_line_error(["diagnose", str(sample)], capsys)


def test_corrupt_dataset_names_the_line(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer"\n')
    with pytest.raises(DatasetError, match=rf"{data}:2"):
        load_dataset(parse_spec({"model": "tiny-qwen3", "dataset": {"kind": "jsonl", "path": str(data)}}).dataset)
    data.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(DatasetError):
        load_dataset(DatasetSpec(kind="jsonl", path=str(data)))


def test_corrupt_weight_file_is_refused_by_its_sha256(tmp_path: Path) -> None:
    import torch

    ref = export_weights({"w": torch.ones(4)}, tmp_path, 1, "fp", "m")
    raw = bytearray(Path(ref.path).read_bytes())
    raw[-1] ^= 1
    Path(ref.path).write_bytes(bytes(raw))
    with pytest.raises(InvalidArgument) as e:
        load_weight_version(ref, "fp")
    assert e.value.violations[0].field == "weights.sha256"


def test_corrupt_controller_state_skips_only_the_bad_record(tmp_path: Path, caplog) -> None:
    store = JobStore(tmp_path)
    for job_id in ("good", "bad"):
        store.save(JobRecord(job_id=job_id, spec={}, state=JobState.RUNNING, step=2))
        for step in (1, 2):
            store.append_event(JobEvent(job_id=job_id, step=step, state=JobState.RUNNING, weight_version=step))
    (tmp_path / "jobs" / "bad" / "job.json").write_text('{"job_id": "bad", "spec"')
    events = tmp_path / "jobs" / "good" / "events.jsonl"
    lines = events.read_text().splitlines()
    events.write_text(lines[0] + "\n" + lines[1][:20] + lines[1] + "\n")  # a torn append, then another
    with caplog.at_level(logging.ERROR):
        loaded = store.load_all()
    assert [(rec.job_id, [e.step for e in evs]) for rec, evs in loaded] == [("good", [1])]
    assert any("jobs/bad/job.json" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    json.loads(lines[1])  # the intact copy of the torn event was valid: only the torn line is dropped
