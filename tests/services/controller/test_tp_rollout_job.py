"""A GRPO job with ``parallel.rollout.tp: 2`` end to end (JobService over gRPC, role services as Ray
actors, the rollout service's engine rank 0 of two, its peer rank a Ray actor it starts): it succeeds
with logdiff exactly 0 against the tp=1 trainer, and its final weights equal bit for bit those of the
same job at tp=1 (the rollout's tokens and logprobs do not depend on its degree, and the trainer is
the same). Both jobs run side by side on one controller."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.controller.convert import spec_to_proto

ROOT = Path(__file__).resolve().parents[3]


def _submit(job_service: object, out: Path, tp: int) -> str:
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    spec.update(steps=2, parallel={"rollout": {"tp": tp}}, checkpoint={"dir": str(out), "interval": 0})
    return job_service.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id


def test_rollout_tp2_job_matches_tp1_bit_for_bit(job_service: object, tmp_path: Path) -> None:
    jobs = {tp: _submit(job_service, tmp_path / f"tp{tp}", tp) for tp in (2, 1)}
    for tp, job_id in jobs.items():
        events = [r.event for r in job_service.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=600)]
        assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_SUCCEEDED", (tp, events[-1].message)
        steps = [e for e in events if e.weight_version]
        assert [e.weight_version for e in steps] == [1, 2]
        assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0 for e in steps)
    final = [load_file(tmp_path / f"tp{tp}" / jobs[tp] / "weights" / "weights-v000002.safetensors") for tp in (2, 1)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
