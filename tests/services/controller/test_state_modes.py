"""Red-team findings 9 and 10: the controller's state, a job's checkpoints and weight versions are
private (directories 0700, files 0600, whatever the umask), and ``/metrics`` carries no server path
as a label value.

A real JobStore and a real trainer service over gRPC on 127.0.0.1 write a job's state the way a
running job does; the metrics are scraped over HTTP from a real endpoint."""

from __future__ import annotations

import json
import os
import secrets
import stat
import urllib.request
from pathlib import Path

import pytest

from onpolicy.kernels import KernelConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.controller.records import JobEvent, JobRecord, JobState
from onpolicy.services.controller.store import JobStore
from onpolicy.services.roles import TrainerOptions, start_role

TOKEN = secrets.token_urlsafe(16)
KV16 = KernelConfig(kv_tile=16)


@pytest.fixture
def open_umask():
    old = os.umask(0o022)  # the usual umask: 755 directories and 644 files unless modes are set
    yield
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_state_checkpoints_and_weights_are_private(tmp_path: Path, open_umask, tiny_paths) -> None:
    store = JobStore(tmp_path / "state")
    rec = JobRecord(job_id="job1", spec={"model": "tiny-qwen3"})
    store.save(rec)
    store.append_event(JobEvent(job_id="job1", step=0, state=JobState.PENDING, message="submitted"))
    job_dir = store.job_dir("job1")
    role = start_role(TrainerOptions(model="tiny-qwen3", kernels=KV16, job="job1", job_dir=str(job_dir)),
                      metrics_host="127.0.0.1", token=TOKEN)
    try:
        stub = api.trainer_pb2_grpc.TrainerServiceStub(connect(role.server.address, token=TOKEN))
        stub.ExportWeights(api.trainer_pb2.ExportWeightsRequest(directory=str(job_dir / "weights")), timeout=60)
        stub.SaveCheckpoint(api.trainer_pb2.SaveCheckpointRequest(
            directory=str(job_dir / "checkpoints"), extra_json=json.dumps({"job_id": "job1"})), timeout=60)
    finally:
        role.stop(grace=0)
    found = modes(tmp_path / "state")
    names = {Path(p).name for p in found}
    assert {"job.json", "events.jsonl", "latest", "manifest.json", "model.safetensors",
            "weights-v000000.safetensors", "step-000000"} <= names, sorted(names)
    for path, mode in found.items():
        want = 0o700 if (tmp_path / path).is_dir() else 0o600
        assert mode == want, f"{path}: {oct(mode)}"


def test_no_server_path_is_a_metrics_label(tmp_path: Path, tiny_paths) -> None:
    from onpolicy.services.common.labels import model_label

    assert model_label("tiny-qwen3") == "tiny-qwen3"
    assert model_label("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_label("/etc") == "etc" and model_label("/srv/models/m.gguf") == "m.gguf"
    assert model_label("./models/a/") == "a" and model_label("~/m") == "m"
    model_dir = str(tiny_paths["tiny-qwen3"])  # an HF directory named by its server path
    role = start_role(TrainerOptions(model=model_dir, kernels=KV16, job="job2"), token=TOKEN,
                      metrics_host="127.0.0.1")
    try:
        text = urllib.request.urlopen(role.metrics.url, timeout=30).read().decode()
    finally:
        role.stop(grace=0)
    assert 'job="job2"' in text and f'model="{Path(model_dir).name}"' in text
    assert model_dir not in text and str(Path(model_dir).parent) not in text

    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.metrics import ControllerMetrics

    controller = JobController(tmp_path / "state", RayLauncher())
    controller.store.save(JobRecord(job_id="job3", spec={"model": model_dir}, state=JobState.SUCCEEDED))
    controller.resume_unfinished()
    labels = [s.labels for fam in ControllerMetrics(controller).collect() for s in fam.samples]
    assert labels and all(lab["model"] == Path(model_dir).name for lab in labels)


def test_private_modes_survive_a_leftover_tmp_and_reach_new_parents(tmp_path: Path, open_umask) -> None:
    from onpolicy.weights import atomic_write_bytes

    target = tmp_path / "shared" / "ck" / "job1" / "weights" / "w.safetensors"
    target.parent.mkdir(parents=True)
    leftover = target.with_name(f".{target.name}.tmp{os.getpid()}")  # an interrupted write's, world-readable
    leftover.write_bytes(b"old")
    os.chmod(leftover, 0o644)
    atomic_write_bytes(target, b"new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_bytes() == b"new"
    fresh = tmp_path / "new-volume" / "a" / "b" / "w.bin"
    atomic_write_bytes(fresh, b"x")
    assert [stat.S_IMODE(d.stat().st_mode) for d in (fresh.parent, fresh.parent.parent, fresh.parent.parent.parent)
            ] == [0o700] * 3


def test_an_existing_state_dir_keeps_its_mode(tmp_path: Path, open_umask) -> None:
    shared = tmp_path / "home"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    JobStore(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # not the store's to change
    assert stat.S_IMODE((shared / "jobs").stat().st_mode) == 0o700


def test_jobs_sharing_a_checkpoint_dir_get_their_own_directories(tmp_path: Path) -> None:
    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services.controller.paths import job_root

    spec = parse_spec({"model": "tiny-qwen3", "checkpoint": {"dir": str(tmp_path / "ck")}})
    a, b = job_root(spec, "jobA", tmp_path / "state/jobs/jobA"), job_root(spec, "jobB", tmp_path / "state/jobs/jobB")
    assert a == tmp_path / "ck" / "jobA" and b == tmp_path / "ck" / "jobB"
    home = parse_spec({"model": "tiny-qwen3", "checkpoint": {"dir": "~/ck"}})
    assert job_root(home, "j", tmp_path) == Path.home() / "ck" / "j"  # ~ expanded, as the path check does
    plain = parse_spec({"model": "tiny-qwen3"})
    assert job_root(plain, "j", tmp_path / "state/jobs/j") == tmp_path / "state/jobs/j"
