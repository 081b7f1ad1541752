"""Faults survived bitwise: the trainer, rollout and verifier actors killed mid-job (Ray restarts
each on a new port) and a restarted controller both resume the job from the trainer's last checkpoint over gRPC; the job
completes every step exactly once, the step after the resume still has logdiff exactly 0, and the
final weights equal those of an uninterrupted run with the same seeds (torch.equal, and the weights'
sha256 — of the tensors: the file's own bytes differ between processes, because safetensors writes
its metadata map in hash order).

Real local Ray, real gRPC on loopback, tiny-qwen3. The runs carry a bearer token; the last test checks
that it never appears in any log record of this process (captured at DEBUG from the first run on),
in the Ray session's logs (every actor's stdout/stderr), or in the controller's state files."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onpolicy.jobs.spec import load_spec_file, parse_spec
from onpolicy.models.loading import weights_sha256
from onpolicy.services.controller.records import JobState

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "resume-test-token-5f1c9a7e"
STEPS = 5  # the last kill (after step 3) must meet a step that still calls the killed service


def spec():
    raw = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    raw.update(steps=STEPS, checkpoint={"dir": "", "interval": 1})
    raw["grpo"] = {**raw["grpo"], "prompts_per_step": 1, "group_size": 2}
    raw["rollout"] = {**raw["rollout"], "max_new_tokens": 8}
    return parse_spec(raw)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(logging.Formatter().format(record))  # message, args and traceback


@pytest.fixture(scope="module")
def logs():
    root, handler = logging.getLogger(), _Records()
    level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    yield handler.texts
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def ray_cluster(logs):
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray()
    yield
    shutdown_ray()


def controller(state: Path):
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController

    return JobController(state, RayLauncher(token=TOKEN, state_dir=state, max_restarts=2))


def final_weights(state: Path, job_id: str) -> tuple[dict[str, torch.Tensor], str]:
    tensors = load_file(state / "jobs" / job_id / "weights" / f"weights-v{STEPS:06d}.safetensors")
    return tensors, weights_sha256(tensors)


def step_events(ctl, job_id: str):
    return [e for e in ctl._job(job_id).events if e.weight_version and not e.message]


def resumes(ctl, job_id: str) -> int:
    return sum(e.message.startswith("resumed from the checkpoint") for e in ctl._job(job_id).events)


def wait_for_step(ctl, job_id: str, step: int, resumed: int = 0, timeout: float = 300) -> None:
    """Until ``step`` steps are completed after at least ``resumed`` resumes."""
    deadline = time.monotonic() + timeout
    while ctl.get(job_id).step < step or resumes(ctl, job_id) < resumed:
        assert time.monotonic() < deadline, "job made no progress"
        assert not ctl.get(job_id).state.terminal, ctl.get(job_id).error
        time.sleep(0.05)


@pytest.fixture(scope="module")
def baseline(ray_cluster, tmp_path_factory):
    state = tmp_path_factory.mktemp("baseline")
    ctl = controller(state)
    job_id = ctl.submit(spec()).job_id
    rec = ctl.wait(job_id, timeout=600)
    assert rec.state is JobState.SUCCEEDED, rec.error
    events = step_events(ctl, job_id)
    ctl.shutdown()
    return final_weights(state, job_id), events, state


def assert_same_run(got: tuple[dict[str, torch.Tensor], str], want: tuple[dict[str, torch.Tensor], str]) -> None:
    (tensors, sha), (want_tensors, want_sha) = got, want
    assert tensors.keys() == want_tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(t, want_tensors[name]), name
    assert sha == want_sha


def assert_every_step_once_logdiff_zero(events, baseline_events) -> None:
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.weight_version for e in events] == list(range(1, STEPS + 1))
    for e, b in zip(events, baseline_events, strict=True):
        assert e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0
        assert e.loss == b.loss and e.reward_mean == b.reward_mean  # the same trajectory


def test_killed_actors_restart_and_the_job_resumes_bitwise(ray_cluster, baseline, tmp_path) -> None:
    import ray

    ctl = controller(tmp_path)
    job_id = ctl.submit(spec()).job_id
    for kills, (step, role) in enumerate(((1, "trainer"), (2, "rollout"), (3, "verifier"))):  # one per role
        wait_for_step(ctl, job_id, step, resumed=kills)  # the previous kill has been survived first
        ray.kill(ray.get_actor(f"onpolicy-{job_id}-{role}"), no_restart=False)
    rec = ctl.wait(job_id, timeout=600)
    assert rec.state is JobState.SUCCEEDED, rec.error
    events = ctl._job(job_id).events
    messages = [e.message for e in events]
    assert sum(m.startswith("lost a service (UNAVAILABLE") for m in messages) >= 3, messages
    resumed = [e for e in events if e.message.startswith("resumed from the checkpoint of step")]
    assert len(resumed) >= 3 and all(1 <= e.step < STEPS for e in resumed), messages
    steps = step_events(ctl, job_id)
    assert_every_step_once_logdiff_zero(steps, baseline[1])
    for r in resumed:  # the first step on the restarted services
        after = next(e for e in steps if e.step == r.step + 1)
        assert after.logdiff_max == 0.0 and after.tokens_checked > 0
    assert_same_run(final_weights(tmp_path, job_id), baseline[0])
    ctl.shutdown()


def test_restarted_controller_resumes_from_the_last_checkpoint_bitwise(ray_cluster, baseline, tmp_path) -> None:
    first = controller(tmp_path)
    job_id = first.submit(spec()).job_id
    wait_for_step(first, job_id, 2)
    first.shutdown()  # leaves the job RUNNING on disk, its services gone
    assert first.get(job_id).state is JobState.RUNNING
    second = controller(tmp_path)
    assert second.resume_unfinished() == [job_id]
    rec = second.wait(job_id, timeout=600)
    assert rec.state is JobState.SUCCEEDED, rec.error
    events = second._job(job_id).events
    ready = [e for e in events if e.message == "services ready"]
    assert len(ready) == 2 and ready[-1].step >= 2  # not rerun from step 0
    steps = [e for e in events if e.weight_version and not e.message]
    assert_every_step_once_logdiff_zero(steps, baseline[1])
    assert_same_run(final_weights(tmp_path, job_id), baseline[0])
    second.shutdown()


def test_the_token_is_never_logged_nor_stored(ray_cluster, baseline, logs) -> None:
    import ray

    assert logs, "no log records were captured"
    assert not [t for t in logs if TOKEN in t]
    ray_logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    scanned = 0
    for root in (ray_logs, baseline[2]):
        for f in root.rglob("*"):
            if f.is_file():
                scanned += 1
                assert TOKEN.encode() not in f.read_bytes(), f
    assert scanned > 10
