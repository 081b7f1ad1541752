"""GRPO jobs whose trainer runs on several ranks, end to end (JobService over gRPC, role services as Ray
actors, the trainer service starting its peer rank as a Ray actor) against a tp=1 rollout:

- ``parallel.trainer.dp: 2`` — the peer holds rank 0's weights after every step (checked by rank 0);
  that two ranks give one worker's bits is tested on the engine and the trainer service, with
  minibatches of several units (this job's fit one unit of the default 4096 rows);
- ``parallel.trainer.tp: 2`` — each rank holds half of every attention and MLP weight.

Each succeeds with logdiff exactly 0 on every step (the rollout's logprobs equal the multi-rank
training path's bit for bit), and its last checkpoint holds exactly the unsharded weights it exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.controller.convert import spec_to_proto
from onpolicy.trainer.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("trainer", [{"dp": 2}, {"tp": 2}], ids=["dp2", "tp2"])
def test_multi_rank_trainer_job_has_logdiff_zero(job_service: object, tmp_path: Path, trainer: dict) -> None:
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    spec.update(steps=2, parallel={"trainer": trainer}, checkpoint={"dir": str(tmp_path), "interval": 1})
    job_id = job_service.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id
    events = [r.event for r in job_service.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=600)]
    assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_SUCCEEDED", events[-1].message
    steps = [e for e in events if e.weight_version]
    assert [e.weight_version for e in steps] == [1, 2]
    assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0 for e in steps)
    exported = load_file(tmp_path / job_id / "weights" / "weights-v000002.safetensors")
    state = load_checkpoint(tmp_path / job_id / "checkpoints")
    assert state.step == 2 and state.model.keys() == exported.keys()
    assert all(torch.equal(state.model[k], exported[k]) for k in exported)
