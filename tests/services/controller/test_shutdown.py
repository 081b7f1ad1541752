"""A stopping controller ends its jobs' calls in flight instead of waiting out a phase: with a rollout
service that stalls inside Generate (fault injection into the real service, in this process),
``JobController.shutdown`` returns with the stall still holding, the job left RUNNING on disk; the
negative control (no ``abort``) shows the same shutdown stuck behind the stall."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onpolicy.jobs.spec import JobSpec, load_spec_file
from onpolicy.kernels import KernelConfig
from onpolicy.services.cluster.actors import close_all
from onpolicy.services.common.client import connect
from onpolicy.services.controller.controller import JobController
from onpolicy.services.controller.loop import RoleStubs
from onpolicy.services.controller.records import JobState
from onpolicy.services.roles import ROLES, start_role
from onpolicy.services.rollout.servicer import RolloutServicer

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "shutdown-test-token"
KV16 = KernelConfig(kv_tile=16)


class Stall:
    """Holds every Generate of the rollout service until released or its caller has gone."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def wrap(self, generate):
        stall = self

        def stalled(servicer, prompts, params, context):
            stall.entered.set()
            while not stall.release.is_set() and context.is_active():
                time.sleep(0.02)
            yield from generate(servicer, prompts, params, context)

        return stalled


class Services:
    """A launcher of one set of in-process role services (tiny-qwen3, loopback): each job gets fresh
    channels to them, and ``abort`` closes those channels (as ``RayLauncher``'s does) unless
    ``with_abort`` is False."""

    def __init__(self, with_abort: bool) -> None:
        self.with_abort = with_abort
        self.servers = {role: start_role(r.options(model="tiny-qwen3", kernels=KV16), token=TOKEN).server
                        for role, r in ROLES.items()}

    @contextlib.contextmanager
    def launch(self, job_id, spec, job_dir=None, notify=None) -> Iterator[RoleStubs]:
        channels = [connect(self.servers[role].address, token=TOKEN) for role in ROLES]
        stubs = {role: ROLES[role].stub(ch) for role, ch in zip(ROLES, channels, strict=True)}
        try:
            yield RoleStubs(**stubs, token=TOKEN, abort=(lambda: close_all(channels)) if self.with_abort else None)
        finally:
            close_all(channels)

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop(grace=0)


@pytest.fixture
def stall(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stall]:
    s = Stall()
    monkeypatch.setattr(RolloutServicer, "_generate", s.wrap(RolloutServicer._generate))
    yield s
    s.release.set()


def spec() -> JobSpec:
    return load_spec_file(ROOT / "examples/jobs/tiny.yaml")


@pytest.mark.parametrize("with_abort", [True, False], ids=["abort", "negative-control-no-abort"])
def test_shutdown_ends_the_calls_in_flight(tmp_path: Path, stall: Stall, with_abort: bool) -> None:
    services = Services(with_abort)
    ctl = JobController(tmp_path, services)
    try:
        job_id = ctl.submit(spec()).job_id
        assert stall.entered.wait(300), ctl.get(job_id).error  # the job is inside its first Generate
        stuck = ctl.shutdown(timeout=60 if with_abort else 3)
        if with_abort:
            assert stuck == [] and not stall.release.is_set()  # ended while the service still stalled
        else:
            assert stuck == [job_id]  # the thread waits on the stalled call
            stall.release.set()
            assert ctl.shutdown(timeout=120) == []
        assert ctl.get(job_id).state is JobState.RUNNING  # resumable: a restart picks it up
        record = json.loads((tmp_path / "jobs" / job_id / "job.json").read_text())
        assert record["state"] == "RUNNING"
    finally:
        stall.release.set()
        ctl.shutdown(timeout=120)
        services.stop()
