"""Mutual TLS between the controller and a job's role services (``RayLauncher(tls=RoleTLS(...))``,
``onpolicy up --role-tls-*``): a real job over real Ray runs with every role serving TLS, its
logprobs still bitwise the trainer's; a plaintext client, or a client without a certificate, is
refused by a role."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest
from tls_support import certificates

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.controller.convert import spec_to_proto

pytest.importorskip("cryptography")
ROOT = Path(__file__).resolve().parents[3]
TOKEN = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    from onpolicy.services.cluster.actors import RoleTLS

    certs = certificates(tmp_path_factory.mktemp("certs"))
    return RoleTLS(cert=str(certs["roles_cert"]), key=str(certs["roles_key"]), ca=str(certs["ca_cert"]))


def test_a_job_runs_with_mutual_tls_to_its_roles(tls, tmp_path: Path) -> None:
    """Every role requires a client certificate, so a job that succeeds talked mTLS to all three."""
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    init_ray()
    controller = JobController(tmp_path / "state", RayLauncher(token=TOKEN, tls=tls))
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_copy(update={"steps": 2})
    try:
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
        job_id = stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id
        evs = [r.event for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=600)]
        assert evs[-1].state == api.jobs_pb2.JOB_STATE_SUCCEEDED, evs[-1].message
        steps = [e for e in evs if e.weight_version]
        assert len(steps) == 2 and all(e.tokens_checked > 0 and e.tokens_mismatched == 0 for e in steps)
    finally:
        controller.shutdown()
        server.stop()
        shutdown_ray()


def test_a_role_serving_role_tls_refuses_plaintext_and_anonymous_clients(tls) -> None:
    """The server configuration the role actors use (``ServiceActor``): only a client with a
    certificate the CA signed, checked under ``server_name``, gets an answer."""
    from onpolicy.services.roles import RolloutOptions, start_role

    role = start_role(RolloutOptions(model="tiny-qwen3"), server_config=ServerConfig(
        port=0, token=TOKEN, tls_cert=tls.cert, tls_key=tls.key, tls_client_ca=tls.ca))
    address = f"127.0.0.1:{role.server.port}"
    info = api.rollout_pb2.RolloutServiceGetInfoRequest()
    name = [("grpc.ssl_target_name_override", tls.server_name)]
    try:
        plain = api.rollout_pb2_grpc.RolloutServiceStub(connect(address, token=TOKEN))
        with pytest.raises(grpc.RpcError) as e:
            plain.GetInfo(info, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous = api.rollout_pb2_grpc.RolloutServiceStub(connect(address, token=TOKEN, tls_ca=tls.ca, options=name))
        with pytest.raises(grpc.RpcError) as e:
            anonymous.GetInfo(info, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        wrong_name = api.rollout_pb2_grpc.RolloutServiceStub(connect(  # the node IP is not what the cert names
            address, token=TOKEN, tls_ca=tls.ca, client_cert=tls.cert, client_key=tls.key))
        with pytest.raises(grpc.RpcError):
            wrong_name.GetInfo(info, timeout=10)
        mutual = api.rollout_pb2_grpc.RolloutServiceStub(connect(
            address, token=TOKEN, tls_ca=tls.ca, client_cert=tls.cert, client_key=tls.key, options=name))
        assert mutual.GetInfo(info, timeout=10).info.kernel_fingerprint
    finally:
        role.stop(grace=0)


def test_role_tls_files_must_exist(tmp_path: Path) -> None:
    from onpolicy.services.cluster.actors import RoleTLS

    with pytest.raises(ValueError, match="role TLS key"):
        RoleTLS(cert=__file__, key=str(tmp_path / "missing.key"), ca=__file__)
