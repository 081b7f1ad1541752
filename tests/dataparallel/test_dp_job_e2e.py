"""A GRPO job with ``parallel.trainer.dp: 2`` end to end (JobService over gRPC, role services as Ray
actors, the trainer starting its peer rank as a Ray actor and checking after every step that the peer
holds its weights): it succeeds with logdiff exactly 0. (That two ranks give one worker's bits is
tested on the engine and on the trainer service, with minibatches of several units; this job's
minibatches fit one unit of the trainer's default 4096 rows.)"""

from __future__ import annotations

from pathlib import Path

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.jobs.convert import spec_to_proto

ROOT = Path(__file__).resolve().parents[2]


def test_dp2_job_runs_with_logdiff_zero(job_service: object, tmp_path: Path) -> None:
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    spec.update(steps=2, parallel={"trainer": {"dp": 2}}, checkpoint={"dir": str(tmp_path), "interval": 0})
    job_id = job_service.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id
    events = [r.event for r in job_service.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=600)]
    assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_SUCCEEDED", events[-1].message
    steps = [e for e in events if e.weight_version]
    assert [e.weight_version for e in steps] == [1, 2]
    assert all(e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0 for e in steps)
    assert (tmp_path / "weights" / "weights-v000002.safetensors").is_file()
