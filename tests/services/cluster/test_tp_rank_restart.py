"""A lost tensor-parallel rank during a job — of the rollout, or of the trainer: its peer actor is
killed after step 1. Rank 0 names it (``PeerFailed``), the service answers UNAVAILABLE and its actor
exits when the loop re-resolves it, Ray restarts it with a fresh peer, and the loop resumes from the
last checkpoint: the job succeeds with logdiff exactly 0 on every step. When the job ends no peer
rank is left."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.controller.convert import spec_to_proto

ROOT = Path(__file__).resolve().parents[3]


def _peers(job_id: str, role: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"onpolicy-{job_id}-{role}-")]


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_lost_rank_is_restarted_and_the_job_succeeds(job_service: object, tmp_path: Path, role: str) -> None:
    import ray

    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    spec.update(steps=3, parallel={role: {"tp": 2}}, checkpoint={"dir": str(tmp_path), "interval": 1})
    job_id = job_service.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id
    events, killed = [], []
    for r in job_service.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=600):
        events.append(r.event)
        if r.event.weight_version == 1 and not killed:
            killed = _peers(job_id, role)
            assert len(killed) == 1, killed
            ray.kill(ray.get_actor(killed[0], namespace=ray.get_runtime_context().namespace))
    assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_SUCCEEDED", events[-1].message
    assert any("reconnecting" in e.message for e in events), [e.message for e in events]
    steps = [e for e in events if e.weight_version]
    assert {e.weight_version for e in steps} == {1, 2, 3}
    assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0 for e in steps)
    deadline = time.monotonic() + 30
    while _peers(job_id, role) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _peers(job_id, role) == []
