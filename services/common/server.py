"""``GrpcServer``: the lifecycle of one gRPC server process-side — options, interceptors, health,
reflection, TLS binding, graceful stop.

Every server gets, besides its own services:

* ``grpc.health.v1.Health`` — SERVING for each registered service and overall (``""``) once started,
  NOT_SERVING during a graceful stop (answered without a token, for probes);
* server reflection listing every registered service, health and reflection (also without a token);
* interceptors, outermost first: bearer-token auth (when a token is set), then the one error mapper.

Servicers that have a ``close()`` method are closed after the server has stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .auth import TokenAuthInterceptor
from .errors import ErrorInterceptor

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options bounding messages both ways (servers and clients use the same)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


#: HTTP/2 keepalive: a client pings an idle connection every ``KEEPALIVE_S`` seconds, also with no
#: call in flight, and a peer that has not answered a ping within ``KEEPALIVE_TIMEOUT_S`` is gone —
#: a stream to a hung or unreachable service then fails with UNAVAILABLE instead of waiting forever.
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0


def keepalive_options(every_s: float = KEEPALIVE_S, timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple[str, int]]:
    """Client keepalive options (pings every ``every_s``, a dead peer after ``timeout_s`` more)."""
    return [("grpc.keepalive_time_ms", int(every_s * 1000)), ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", int(every_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000))]


def server_keepalive_options(every_s: float = 2 * KEEPALIVE_S) -> list[tuple[str, int]]:
    """Server keepalive options: it pings its clients every ``every_s`` too, and accepts their pings
    as often as once a second (more often is a client misbehaving)."""
    return [("grpc.keepalive_time_ms", int(every_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 0)]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind (``0.0.0.0`` / ``[::]`` to serve beyond this machine)."""
    port: int = 0
    """Port to bind; 0 picks a free one (``GrpcServer.start`` returns it)."""
    token: str | None = field(default=None, repr=False)
    """Bearer token every RPC but health and reflection must carry; None switches auth off."""
    tls_cert: str | None = None
    """PEM certificate chain file; with ``tls_key`` the server speaks TLS only."""
    tls_key: str | None = None
    """PEM private key file of ``tls_cert``."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest request or response message; larger ones fail with RESOURCE_EXHAUSTED."""
    grace_seconds: float = 5.0
    """How long ``stop`` lets in-flight RPCs finish before cancelling them."""
    max_workers: int = 16
    """Handler threads, i.e. concurrent RPCs (a streaming RPC holds one while it streams)."""
    max_concurrent_rpcs: int | None = 256
    """Most RPCs held at once, running or waiting for a handler thread; one more is answered
    RESOURCE_EXHAUSTED at once, so waiting requests cannot pile up in memory (None = no bound)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.token is not None and not self.token.strip():
            raise ValueError("token must not be empty (use None to switch authentication off)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("mutual TLS (tls_client_ca) needs tls_cert and tls_key")
        if self.max_message_bytes < 1 or self.max_workers < 1 or self.grace_seconds < 0:
            raise ValueError("max_message_bytes and max_workers must be >= 1 and grace_seconds >= 0")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1 (or None)")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def credentials(self) -> grpc.ServerCredentials:
        assert self.tls_cert is not None and self.tls_key is not None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        client_ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)


Registrar = Callable[[Any, grpc.Server], None]


class GrpcServer:
    """One gRPC server: ``add_service`` the servicers, ``start()``, ``stop()`` (or use ``with``)."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        interceptors: list[grpc.ServerInterceptor] = []
        if self.config.token is not None:
            interceptors.append(TokenAuthInterceptor(self.config.token))
        interceptors.append(ErrorInterceptor())
        self._server = grpc.server(ThreadPoolExecutor(self.config.max_workers, thread_name_prefix="grpc"),
                                   interceptors=interceptors,
                                   options=[*message_options(self.config.max_message_bytes),
                                            *server_keepalive_options()],
                                   maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._services: dict[str, Any] = {}
        self.port: int | None = None
        self._stopped = False

    @property
    def service_names(self) -> list[str]:
        return [*self._services, HEALTH_SERVICE, reflection.SERVICE_NAME]

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host in ("::", "[::]") else host
        return f"{host}:{self.port}"

    def add_service(self, name: str, servicer: Any, register: Registrar) -> None:
        """Register ``servicer`` with its generated ``add_XServicer_to_server`` under its full
        service name (e.g. ``onpolicy.v1.RolloutService``); only before ``start``."""
        if self.port is not None or self._stopped:
            raise RuntimeError("add services before start()")
        if name in self._services:
            raise ValueError(f"service {name} is already registered")
        register(servicer, self._server)
        self._services[name] = servicer

    def start(self) -> int:
        """Bind, start serving and mark every service SERVING; returns the bound port."""
        if self.port is not None or self._stopped:
            raise RuntimeError("a GrpcServer starts once")
        reflection.enable_server_reflection(self.service_names, self._server)
        target = f"{self.config.host}:{self.config.port}"
        if ":" in self.config.host and not self.config.host.startswith("["):
            target = f"[{self.config.host}]:{self.config.port}"
        if self.config.tls:
            port = self._server.add_secure_port(target, self.config.credentials())
        else:
            port = self._server.add_insecure_port(target)
        if not port:
            raise RuntimeError(f"could not bind {target}")
        self._server.start()
        self.port = port
        for name in self._services:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s (%s, auth %s)", ", ".join(self._services) or "nothing", target,
                 "TLS" if self.config.tls else "plaintext", "on" if self.config.token else "off")
        return port

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); True if it stopped."""
        return self._server.wait_for_termination(timeout)

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for ``grace`` seconds (default from the
        config), stop, then close the servicers."""
        if self.port is None or self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self._server.stop(self.config.grace_seconds if grace is None else grace).wait()
        for servicer in self._services.values():
            close = getattr(servicer, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> GrpcServer:
        if self.port is None and not self._stopped:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
