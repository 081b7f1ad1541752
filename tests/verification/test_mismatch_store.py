"""The mismatch store: the N worst samples per job, atomic JSON files, a documented schema."""

from __future__ import annotations

import json
from pathlib import Path

from onpolicy.verification.mismatch_store import KIND, MismatchRecord, MismatchStore, job_dirname, load_mismatch

SCHEMA_KEYS = {"model", "kernel_fingerprint", "weight_version", "weights_path", "prompt_ids", "token_ids",
               "logprobs", "trainer_logprobs", "temperature", "source", "job_id", "step", "max_abs_logdiff",
               "first_mismatch_index"}


def record(job: str, step: int, max_abs: float) -> MismatchRecord:
    return MismatchRecord(model="tiny-qwen3", kernel_fingerprint="", trainer_kernel_fingerprint="ref",
                          weight_version=3, weights_path="/w/weights-v000003.safetensors", prompt_ids=[1, 2],
                          token_ids=[3, 4, 5], logprobs=[-1.0, -2.0 + max_abs, -0.5],
                          trainer_logprobs=[-1.0, -2.0, -0.5],
                          temperature=1.0, source="vllm", job_id=job, step=step, max_abs_logdiff=max_abs,
                          first_mismatch_index=1, mismatched_tokens=1)


def test_keeps_the_n_worst_per_job(tmp_path: Path) -> None:
    store = MismatchStore(tmp_path, keep=3)
    for step, m in enumerate([0.1, 0.5, 0.01, 0.3, 0.2, 0.05]):
        store.offer(record("a", step, m))
    store.offer(record("b", 0, 0.001))
    kept = [load_mismatch(p).max_abs_logdiff for p in store.paths("a")]
    assert kept == [0.5, 0.3, 0.2]  # worst first
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in store.paths("a"))
    assert [load_mismatch(p).max_abs_logdiff for p in store.paths("b")] == [0.001]
    assert not store.wants("a", 0.1) and store.wants("a", 0.6) and not store.wants("a", 0.0)
    assert store.offer(record("a", 99, 0.0)) is None  # bitwise equal samples are never stored
    # A restarted verifier rescans the directory and keeps the bound.
    again = MismatchStore(tmp_path, keep=3)
    assert again.offer(record("a", 50, 0.15)) is None
    assert again.offer(record("a", 51, 0.9)) is not None
    assert [load_mismatch(p).max_abs_logdiff for p in again.paths("a")] == [0.9, 0.5, 0.3]
    assert len(list((tmp_path / "a").iterdir())) == 3


def test_files_are_complete_json_with_the_documented_schema(tmp_path: Path) -> None:
    store = MismatchStore(tmp_path, keep=2)
    path = store.offer(record("job1", 7, 0.25))
    assert path is not None and path.parent == tmp_path / "job1" and path.name.startswith("step000007-")
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary files left
    data = json.loads(path.read_text())
    assert data["kind"] == KIND and data["schema_version"] == 1
    assert set(data) >= SCHEMA_KEYS
    assert data["step"] == 7 and data["job_id"] == "job1" and data["source"] == "vllm"
    assert load_mismatch(path) == MismatchRecord.from_json(data)
    assert store.offer(record("job1", 7, 0.25)) == path  # the same sample twice is one file


def test_job_ids_cannot_escape_the_store(tmp_path: Path) -> None:
    for job in ("../../etc", "a/b", "..", ".hidden", "x" * 200):
        name = job_dirname(job)
        assert "/" not in name and name not in (".", "..") and not name.startswith(".")
        path = MismatchStore(tmp_path, keep=1).offer(record(job, 0, 0.5))
        assert path is not None and path.resolve().parent.parent == tmp_path.resolve()
    assert job_dirname("") == "_nojob" and job_dirname("3f2a9c") == "3f2a9c"
