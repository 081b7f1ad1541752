"""Role services as Ray actors: each actor serves one gRPC server (rollout, trainer or verifier),
so the controller talks to it only over gRPC — and the same service could run in its own pod.

Metrics: given a ``MetricsHub`` (``onpolicy up --metrics-port``), the launcher has every actor
also serve its ``/metrics`` on an ephemeral port of its host, registers those URLs with the hub
for the job's lifetime, and retires them (final snapshot) before the actors are killed — see
``services.common.metrics_endpoint``. The verifier's mismatch store goes to
``<the job's directory>/mismatches`` (``services.controller.paths.job_root``; ``$ONPOLICY_HOME/mismatches``
when the launcher knows none).

Restarts: every actor is created with ``max_restarts`` (``onpolicy up --max-restarts``, default 3).
A restarted actor builds a fresh role server on a new port; the stubs the launcher yields carry a
``reconnect`` that waits for every actor to answer again, re-resolves their addresses and
reconnects (the loop then restores the trainer's checkpoint and re-pushes that weight version).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onpolicy.jobs.spec import JobSpec

from ..controller.loop import RoleStubs
from .local_ray import ray_env
from .placement import PLACEMENT_TIMEOUT_S, JobPlacement, actor_options

log = logging.getLogger(__name__)
DEFAULT_MAX_RESTARTS = 3
#: How long ``reconnect`` waits for a restarted actor to serve again.
RESOLVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RoleTLS:
    """Mutual TLS between the controller and a job's role services: PEM files readable at the same
    paths on every node (e.g. a Kubernetes Secret the chart mounts). Each role serves TLS with
    ``cert``/``key`` and accepts only clients whose certificate ``ca`` signed; the controller
    presents the same certificate and checks the role's against ``ca`` under the name
    ``server_name`` (which the certificate must carry: roles listen on node IPs that no certificate
    can name in advance)."""

    cert: str
    key: str
    ca: str
    server_name: str = "onpolicy-roles"

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            if not Path(getattr(self, name)).is_file():
                raise ValueError(f"role TLS {name}: {getattr(self, name)}: no such file")


class RoleStartupError(RuntimeError):
    """A role service could not start (its model does not load, its backend is not certified, …):
    not retried, the job fails with this one-line message."""

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray's process boundary as itself
        return (RoleStartupError, self.args)


class ServiceActor:
    """Body of the Ray actor (wrapped with ``ray.remote`` on first use). A role that fails to start
    keeps the actor alive and answers ``address`` with a ``RoleStartupError``: restarting it would
    only fail again."""

    def __init__(self, options: Any, host: str, token: str | None, threads: int, metrics: bool = False,
                 tls: dict[str, str] | None = None) -> None:
        ray_env()
        import torch

        torch.set_num_threads(max(1, threads))
        from ..roles import start_role

        self.role_name = role = options.role
        self.startup_error = ""
        host = bind_host(host)
        try:
            from ..common.server import ServerConfig

            config = ServerConfig(host=host, port=0, token=token, tls_cert=tls["cert"], tls_key=tls["key"],
                                  tls_client_ca=tls["ca"]) if tls else None
            self.role = start_role(options, host=host, token=token, metrics_host=host if metrics else None,
                                   server_config=config)
        except Exception as e:
            log.exception("the %s service could not start", role)
            first = str(e).splitlines()[0] if str(e) else ""
            self.startup_error = f"the {role} service could not start: {type(e).__name__}: {first}"
            return
        self.server = self.role.server
        self.host = advertised_host(host)

    def address(self) -> str:
        """Where the service answers; a service whose engine stopped (e.g. a lost tensor-parallel or
        data-parallel peer rank) exits instead, so Ray restarts it with fresh peers and the caller
        resolves the new one."""
        if self.startup_error:
            raise RoleStartupError(self.startup_error)
        if self.role_name == "rollout":
            worker = self.role.servicer.worker
            stopped = not worker.alive or worker.engine.failed
        else:
            stopped = self.role.servicer.failed
        if stopped:
            log.error("the %s engine has stopped; exiting so that Ray restarts this service", self.role_name)
            os._exit(1)
        return f"{self.host}:{self.server.port}"

    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of this service ("" when started without metrics)."""
        if self.startup_error or self.role.metrics is None:
            return ""
        return f"http://{self.host}:{self.role.metrics.url.rsplit(':', 1)[1]}"

    def stop(self) -> None:
        if not self.startup_error:
            self.role.stop(grace=1.0)


NODE_HOST = "node"
"""``--service-host node``: each role service binds exactly the IP Ray reports for its node."""


def bind_host(host: str) -> str:
    """The address a role service binds for the launcher's ``host``: its node's IP for ``node``."""
    if host == NODE_HOST:
        import ray

        return str(ray.util.get_node_ip_address())
    return host


def advertised_host(bind: str) -> str:
    """The address other nodes reach a service bound to ``bind`` at: the node's IP for a wildcard
    bind (services of a multi-node cluster, e.g. KubeRay worker pods), else ``bind`` itself."""
    if bind in ("0.0.0.0", "::", "[::]", ""):
        import ray

        return str(ray.util.get_node_ip_address())
    return bind


_REMOTE: Any = None


def _remote_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(ServiceActor)
    return _REMOTE


def resolve_address(actor: Any, timeout_s: float = RESOLVE_TIMEOUT_S) -> str:
    """The gRPC address ``actor`` serves on, waiting while Ray restarts it (a call that reached it
    as it died fails with ``RayActorError``: retried until ``timeout_s``; then the error stands). A
    service that could not start raises its ``RoleStartupError`` at once."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return str(ray.get(actor.address.remote(), timeout=max(1.0, deadline - time.monotonic())))
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RoleStartupError):
                raise RoleStartupError(*e.cause.args) from None
            raise
        except ray.exceptions.RayActorError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


#: How often a running job's nodes are checked (``NodeWatch``).
NODE_WATCH_S = 1.0


class NodeWatch:
    """Checks every ``NODE_WATCH_S`` seconds that the nodes holding a job's ranks are alive, and tells
    ``notify`` once about each one that dies: ``lost node 127.0.0.3 (trainer, rollout rank 1)``."""

    def __init__(self, placement: JobPlacement, notify: Callable[[str], None]) -> None:
        self.placement, self.notify = placement, notify
        self._stop = threading.Event()
        self._reported: set[str] = set()
        self._last: dict[str, list[str]] = {}
        self._thread = threading.Thread(target=self._run, name="onpolicy-node-watch", daemon=True)

    def start(self) -> None:
        """Note where the ranks are now (a node lost before the first check is still known), then watch."""
        self._last = self.placement.nodes()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> list[str]:
        """The messages for nodes of the job found dead since the last check."""
        import ray

        now = self.placement.nodes()
        ranks = {**now, **{n: held for n, held in self._last.items() if n not in now}}  # placed elsewhere since
        self._last = now
        dead = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if not n.get("Alive", True)}
        out = []
        for node, held in ranks.items():
            if node in dead and node not in self._reported:
                self._reported.add(node)
                out.append(f"lost node {dead[node]} ({', '.join(held)}); its ranks are placed again")
        return out

    def _run(self) -> None:
        while not self._stop.wait(NODE_WATCH_S):
            try:
                for message in self.check():
                    self.notify(message)
            except Exception:  # the cluster's state API is unreachable for a moment: check again
                log.debug("node watch check failed", exc_info=True)


def close_all(channels: list[Any]) -> None:
    """Close every channel in ``channels`` (idempotent; calls in flight on them end with CANCELLED)."""
    for ch in list(channels):
        ch.close()


class RayLauncher:
    """Starts a job's three role services as Ray actors (resources ``{"NPU": n}`` on Ascend, CPUs
    otherwise, restarted by Ray up to ``max_restarts`` times), connects gRPC stubs to them (and
    reconnects after a restart), and kills them when the job ends.

    ``metrics``: a ``MetricsHub`` the services' ``/metrics`` endpoints are registered with.
    ``state_dir``: the controller's state directory (its jobs' work dirs are ``state_dir/jobs/<id>``),
    under which the verifier keeps its mismatch store unless the spec names a checkpoint dir.
    ``placement_timeout_s``: how long a job waits for the cluster to reserve all of its ranks.
    ``token``: the controller's own token, never handed to a role: each launch makes a fresh token
    for that job's roles (``services.common.auth.new_role_token``), so one job's token cannot drive
    another job's services."""

    def __init__(self, host: str = "127.0.0.1", token: str | None = None, *, metrics: Any = None,
                 state_dir: str | Path | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 tls: RoleTLS | None = None, placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        if max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        self.host, self.token, self.tls = host, token, tls
        self.loopback = host.startswith("127.") or host in ("localhost", "::1", "[::1]")
        self.metrics = metrics
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.max_restarts = max_restarts
        self.placement_timeout_s = placement_timeout_s

    def _connect(self, job_id: str, actors: dict[str, Any], channels: list[Any], token: str,
                 aborted: threading.Event) -> RoleStubs:
        """Stubs to the actors' current addresses (closing the channels of a previous connection),
        authenticated with the job's own role ``token``."""
        import ray

        from ..common.client import connect
        from ..roles import ROLES

        addresses = {role: resolve_address(a) for role, a in actors.items()}
        log.info("job %s services: %s", job_id, addresses)
        close_all(channels)
        channels.clear()
        if self.metrics is not None:
            for role, a in actors.items():
                self.metrics.add_target(job_id, role, ray.get(a.metrics_url.remote()))
        stubs = {}
        for role in actors:
            if self.tls is not None:  # mutual TLS: the token travels encrypted
                ch = connect(addresses[role], token=token, tls_ca=self.tls.ca, client_cert=self.tls.cert,
                             client_key=self.tls.key, options=[("grpc.ssl_target_name_override",
                                                                self.tls.server_name)])
            else:  # off-loopback the token crosses the cluster network in plaintext (docs/deploy.md)
                ch = connect(addresses[role], token=token, allow_insecure_token=not self.loopback)
            channels.append(ch)
            stubs[role] = ROLES[role].stub(ch)
        if aborted.is_set():  # aborted while this (re)connection was being made: its calls end at once too
            close_all(channels)

        def abort() -> None:
            aborted.set()
            close_all(channels)

        return RoleStubs(**stubs, reconnect=lambda: self._connect(job_id, actors, channels, token, aborted),
                         token=token, abort=abort)

    @contextlib.contextmanager
    def launch(self, job_id: str, spec: JobSpec, job_dir: str | Path | None = None,
               notify: Callable[[str], None] | None = None) -> Iterator[RoleStubs]:
        """The job's role services, authenticated with a token of the job's own (never the
        controller's), the trainer confined to ``job_dir`` (default: the checkpoint dir, or the
        job's work dir under ``state_dir``; neither known: not confined). Every rank of every role
        is reserved first, in one placement group (``placement.reserve``: all or none); while the
        job runs, a node that dies with some of its ranks is reported to ``notify`` within about
        ``NODE_WATCH_S`` seconds, naming the node and the ranks it held."""
        import ray

        from ..common.auth import new_role_token
        from ..roles import ROLES, options_for
        from .placement import reserve

        remote = _remote_class()
        token = new_role_token()  # in memory only: the actors' arguments and this job's channels
        if job_dir is None and (spec.checkpoint.dir or self.state_dir is not None):
            from ..controller.paths import job_root

            job_dir = job_root(spec, job_id, self.state_dir / "jobs" / job_id if self.state_dir else "")
        job_dir = str(Path(job_dir).absolute()) if job_dir else ""
        actors = {}
        channels: list[Any] = []
        mismatch_dir = str(Path(job_dir) / "mismatches") if job_dir else ""
        placement = reserve(spec, job_id, self.placement_timeout_s)
        watch = NodeWatch(placement, notify) if notify is not None else None
        try:
            for role in ROLES:
                res = spec.resources_for(role)
                actors[role] = remote.options(
                    name=f"onpolicy-{job_id}-{role}", max_restarts=self.max_restarts,
                    **actor_options(res.npus, res.cpus), **placement.for_service(role),
                ).remote(options_for(spec, role, job_id, job_dir, mismatch_dir, placement.peers(role)), self.host,
                         token, max(1, int(res.cpus)), self.metrics is not None,
                         asdict(self.tls) if self.tls is not None else None)
            stubs = self._connect(job_id, actors, channels, token, threading.Event())
            if watch is not None:
                watch.start()
            yield stubs
        finally:
            if watch is not None:
                watch.stop()
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    self.metrics.retire(job_id)  # final snapshot, while the services still answer
            close_all(channels)
            for a in actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(a)
            with contextlib.suppress(Exception):
                placement.remove()
