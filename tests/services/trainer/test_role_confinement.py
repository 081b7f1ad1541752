"""Red-team findings 1 and 2: a job's trainer serves only its own job directory and its own job's
checkpoints, and each job's role services accept only that job's token.

Real gRPC on 127.0.0.1 against a real trainer service (``start_role``), and a real local Ray with
two jobs launched by ``RayLauncher``."""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import grpc
import pytest

from onpolicy.jobs.spec import parse_spec
from onpolicy.kernels import KernelConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.roles import TrainerOptions, start_role

TOKEN = secrets.token_urlsafe(16)
KV16 = KernelConfig(kv_tile=16)
tp = api.trainer_pb2


def refused(call, code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    named = [f for f, _ in field_violations(e.value)] or [e.value.details().split(":", 1)[0]]
    assert field in named, (named, e.value.details())
    return e.value.details()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A trainer launched for job ``job-a`` whose directory is ``state/jobs/job-a``."""
    root = tmp_path_factory.mktemp("confine")
    mine, other, outside = root / "state" / "jobs" / "job-a", root / "state" / "jobs" / "job-b", root / "outside"
    for d in (mine, other, outside):
        d.mkdir(parents=True)
    (mine / "escape").symlink_to(outside, target_is_directory=True)
    role = start_role(TrainerOptions(model="tiny-qwen3", kernels=KV16, job="job-a", job_dir=str(mine)),
                      token=TOKEN)
    channel = connect(role.server.address, token=TOKEN)
    yield api.trainer_pb2_grpc.TrainerServiceStub(channel), mine, other, outside
    channel.close()
    role.stop(grace=0)


def test_writes_outside_the_job_directory_are_refused(trainer) -> None:
    stub, mine, other, outside = trainer
    bad = {str(outside / "w"): grpc.StatusCode.PERMISSION_DENIED,              # absolute, elsewhere
           str(other / "weights"): grpc.StatusCode.PERMISSION_DENIED,          # another job's directory
           str(mine / "escape" / "w"): grpc.StatusCode.PERMISSION_DENIED,      # a symlink out
           str(mine / ".." / ".." / ".." / "outside"): grpc.StatusCode.INVALID_ARGUMENT,
           "state/jobs/job-a/weights": grpc.StatusCode.INVALID_ARGUMENT}       # relative
    for directory, code in bad.items():
        refused(lambda d=directory: stub.ExportWeights(tp.ExportWeightsRequest(directory=d), timeout=60),
                code, "directory")
        refused(lambda d=directory: stub.SaveCheckpoint(tp.SaveCheckpointRequest(directory=d), timeout=60),
                code, "directory")
        refused(lambda d=directory: stub.RestoreCheckpoint(tp.RestoreCheckpointRequest(directory=d), timeout=60),
                code, "directory")
    assert not any(outside.iterdir()) and not any(other.iterdir())
    ref = stub.ExportWeights(tp.ExportWeightsRequest(directory=str(mine / "weights")), timeout=60).weights
    assert Path(ref.path).parent == mine / "weights" and Path(ref.path).is_file()


def test_a_forged_job_id_neither_writes_nor_restores(trainer) -> None:
    stub, mine, other, _ = trainer
    forged = json.dumps({"step": 0, "job_id": "evil"})
    detail = refused(lambda: stub.SaveCheckpoint(tp.SaveCheckpointRequest(directory=str(mine / "checkpoints"),
                                                                          extra_json=forged), timeout=60),
                     grpc.StatusCode.PERMISSION_DENIED, "extra_json.job_id")
    assert "'evil'" in detail and not (mine / "checkpoints").exists()
    saved = stub.SaveCheckpoint(tp.SaveCheckpointRequest(directory=str(mine / "checkpoints"),
                                                         extra_json=json.dumps({"step": 0, "job_id": "job-a"})),
                                timeout=60)
    assert Path(saved.path).parent == mine / "checkpoints"
    # another job's checkpoint placed inside this job's directory is still not restored
    other_role = start_role(TrainerOptions(model="tiny-qwen3", kernels=KV16, job="job-b",
                                                   job_dir=str(other)), token=TOKEN)
    try:
        other_stub = api.trainer_pb2_grpc.TrainerServiceStub(connect(other_role.server.address, token=TOKEN))
        other_stub.SaveCheckpoint(tp.SaveCheckpointRequest(directory=str(other / "checkpoints"),
                                                           extra_json=json.dumps({"job_id": "job-b"})), timeout=60)
    finally:
        other_role.stop(grace=0)
    shutil.copytree(other / "checkpoints", mine / "foreign")
    before = stub.GetInfo(tp.TrainerServiceGetInfoRequest(), timeout=30).info.weight_sha256
    detail = refused(lambda: stub.RestoreCheckpoint(tp.RestoreCheckpointRequest(directory=str(mine / "foreign")),
                                                    timeout=60), grpc.StatusCode.PERMISSION_DENIED, "directory")
    assert "'job-b'" in detail
    assert stub.GetInfo(tp.TrainerServiceGetInfoRequest(), timeout=30).info.weight_sha256 == before
    restored = stub.RestoreCheckpoint(tp.RestoreCheckpointRequest(directory=str(mine / "checkpoints")), timeout=60)
    assert restored.step == 0 and json.loads(restored.extra_json)["job_id"] == "job-a"


@pytest.fixture(scope="module")
def ray_local():
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray()
    yield
    shutdown_ray()


def test_each_job_drives_only_its_own_role_services(ray_local, tmp_path: Path) -> None:
    import ray

    from onpolicy.services.cluster.actors import RayLauncher, resolve_address

    state = tmp_path / "state"
    launcher = RayLauncher(token=TOKEN, state_dir=state)
    spec = parse_spec({"model": "tiny-qwen3", "kernels": {"kv_tile": 16}})
    with launcher.launch("joba", spec) as a, launcher.launch("jobb", spec) as b:
        assert a.token and b.token and len({a.token, b.token, TOKEN}) == 3
        assert a.token not in repr(a)
        assert a.trainer.GetInfo(tp.TrainerServiceGetInfoRequest(), timeout=60).info.service == "trainer"
        address = resolve_address(ray.get_actor("onpolicy-joba-trainer"))
        for token in (TOKEN, b.token):  # the controller's token, and another job's
            channel = connect(address, token=token)
            with pytest.raises(grpc.RpcError) as e:
                api.trainer_pb2_grpc.TrainerServiceStub(channel).GetInfo(tp.TrainerServiceGetInfoRequest(), timeout=30)
            channel.close()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the launcher confined job A's trainer to state/jobs/joba
        refused(lambda: a.trainer.ExportWeights(tp.ExportWeightsRequest(directory=str(state / "jobs" / "jobb")),
                                                timeout=60), grpc.StatusCode.PERMISSION_DENIED, "directory")
        ref = a.trainer.ExportWeights(tp.ExportWeightsRequest(directory=str(state / "jobs" / "joba" / "weights")),
                                      timeout=60).weights
        assert Path(ref.path).is_file()
        tokens = (a.token, b.token)
    ray_logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    scanned = 0
    for root in (ray_logs, state):
        for f in root.rglob("*"):
            if f.is_file():
                scanned += 1
                data = f.read_bytes()
                assert not [t for t in tokens if t.encode() in data], f
    assert scanned > 5


def test_a_checkpoint_dir_overlapping_the_job_directories_is_refused(tmp_path: Path) -> None:
    from onpolicy.services.controller.paths import PathRefused, PathRoots, check_paths

    state = tmp_path / "state"
    (state / "jobs" / "other").mkdir(parents=True)
    roots = PathRoots(state=state)
    for directory in (state, state / "jobs", state / "jobs" / "other" / "ck"):
        with pytest.raises(PathRefused) as e:
            check_paths(parse_spec({"model": "tiny-qwen3", "checkpoint": {"dir": str(directory)}}), roots)
        assert e.value.field == "checkpoint.dir" and e.value.denied and "overlaps" in str(e.value)
    check_paths(parse_spec({"model": "tiny-qwen3", "checkpoint": {"dir": str(state / "ck")}}), roots)
