"""Role services as Ray actors: each actor serves one gRPC server (rollout, trainer or verifier),
so the controller talks to it only over gRPC — and the same service could run in its own pod."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from onpolicy.jobs.spec import JobSpec
from onpolicy.kernels.ascend.placement import actor_options

from ..jobs.loop import RoleStubs
from .local_ray import ray_env

log = logging.getLogger(__name__)
ROLES = ("rollout", "trainer", "verifier")


class ServiceActor:
    """Body of the Ray actor (wrapped with ``ray.remote`` on first use)."""

    def __init__(self, role: str, options: dict[str, Any], host: str, token: str | None, threads: int) -> None:
        ray_env()
        import torch

        torch.set_num_threads(max(1, threads))
        from ..roles import RoleOptions, start_role_server

        self.server = start_role_server(role, RoleOptions(**options), host=host, token=token)
        self.host = host

    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    def stop(self) -> None:
        self.server.stop(grace=1.0)


_REMOTE: Any = None


def _remote_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(ServiceActor)
    return _REMOTE


def role_options(spec: JobSpec, role: str) -> dict[str, Any]:
    from ..roles import RoleOptions

    kernels = spec.rollout.kernels if role == "rollout" else "consistent"
    backend = "fast" if kernels == "fast" else spec.kernels.backend
    opts = RoleOptions(model=spec.model, backend=backend, dtype=spec.kernels.dtype, kv_tile=spec.kernels.kv_tile,
                       max_num_seqs=spec.rollout.max_num_seqs, max_batched_tokens=spec.rollout.max_batched_tokens,
                       weights_fingerprint_backend=spec.kernels.backend)
    return asdict(opts)


class RayLauncher:
    """Starts a job's three role services as Ray actors (resources ``{"NPU": n}`` on Ascend, CPUs
    otherwise), connects gRPC stubs to them, and kills them when the job ends."""

    def __init__(self, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.host, self.token = host, token

    @contextlib.contextmanager
    def launch(self, job_id: str, spec: JobSpec) -> Iterator[RoleStubs]:
        import ray

        from onpolicy.services import api

        from ..common.client import connect

        remote = _remote_class()
        actors = {}
        channels = []
        try:
            for role in ROLES:
                res = spec.resources_for(role)
                actors[role] = remote.options(
                    name=f"onpolicy-{job_id}-{role}", max_restarts=0, **actor_options(res.npus, res.cpus),
                ).remote(role, role_options(spec, role), self.host, self.token, max(1, int(res.cpus)))
            addresses = {role: ray.get(a.address.remote()) for role, a in actors.items()}
            log.info("job %s services: %s", job_id, addresses)
            stubs = {}
            for role, stub_cls in (("rollout", api.rollout_pb2_grpc.RolloutServiceStub),
                                   ("trainer", api.trainer_pb2_grpc.TrainerServiceStub),
                                   ("verifier", api.verifier_pb2_grpc.VerifierServiceStub)):
                ch = connect(addresses[role], token=self.token)
                channels.append(ch)
                stubs[role] = stub_cls(ch)
            yield RoleStubs(**stubs)
        finally:
            for ch in channels:
                ch.close()
            for a in actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(a)
