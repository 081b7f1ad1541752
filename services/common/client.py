"""Client side of the plumbing: ``connect`` (TLS, mutual TLS, bearer token, message limits, keepalive,
retries of idempotent calls) and ``field_violations`` to read the ``google.rpc.BadRequest`` details
of an INVALID_ARGUMENT error."""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from .auth import bearer
from .server import DEFAULT_MAX_MESSAGE_BYTES, keepalive_options, message_options

PathLike = str | os.PathLike[str]


#: Calls that are safe to send again (reads, and writes that set a state rather than change it: the same
#: weight version loaded or exported twice is the same state). ``connect`` has gRPC retry them when the
#: service answers UNAVAILABLE (restarting, or a connection reset), with exponential backoff. The others
#: (TrainStep, SubmitSamples, Generate, SubmitJob, SaveCheckpoint, WatchJob) are never re-sent by the
#: channel: their callers decide (the GRPO loop resumes from the last checkpoint).
IDEMPOTENT_METHODS: dict[str, tuple[str, ...]] = {
    "onpolicy.v1.RolloutService": ("GetInfo", "UpdateWeights"),
    "onpolicy.v1.TrainerService": ("GetInfo", "ComputeLogprobs", "ExportWeights", "RestoreCheckpoint"),
    "onpolicy.v1.VerifierService": ("GetInfo", "GetReport", "UpdateWeights"),
    "onpolicy.v1.JobService": ("GetJob", "ListJobs", "CancelJob"),
    "grpc.health.v1.Health": ("Check",),
}
RETRY_ATTEMPTS = 5
"""Attempts of an idempotent call in all (gRPC caps this at 5)."""


def retry_options() -> list[tuple[str, Any]]:
    """Channel options: retries on UNAVAILABLE for ``IDEMPOTENT_METHODS`` (0.2 s, 0.4 s, … up to 3 s)."""
    policy = {"maxAttempts": RETRY_ATTEMPTS, "initialBackoff": "0.2s", "maxBackoff": "3s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    names = [{"service": svc, "method": m} for svc, methods in IDEMPOTENT_METHODS.items() for m in methods]
    return [("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]}))]


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _CallDetails(_Details, grpc.ClientCallDetails):
    pass


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                         grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a plaintext channel (gRPC refuses call credentials
    there, rightly: ``connect`` only allows it for loopback addresses unless told otherwise)."""

    def __init__(self, token: str) -> None:
        self._entry = bearer(token)

    def __repr__(self) -> str:
        return "_BearerInterceptor(token=<redacted>)"

    def _add(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def _call(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._add(details), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


def is_loopback(address: str) -> bool:
    """True for ``127.x``/``[::1]``/``localhost`` addresses and Unix sockets."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect(address: str, token: str | None = None, tls_ca: PathLike | None = None,
            client_cert: PathLike | None = None, client_key: PathLike | None = None, *, tls: bool = False,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, allow_insecure_token: bool = False,
            options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``address`` (``host:port``), with keepalive and retries of the idempotent calls.

    TLS is used when ``tls`` is set or any of ``tls_ca`` (PEM file of the CA that signed the server,
    default: system roots), ``client_cert``/``client_key`` (PEM files, mutual TLS) is given; the token
    then travels as call credentials. On a plaintext channel the token is added by an interceptor,
    which is refused (ValueError) for non-loopback addresses unless ``allow_insecure_token``.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together")
    # later entries win: the caller's options over the defaults
    merged = [*message_options(max_message_bytes), *keepalive_options(), *retry_options(), *(options or [])]
    opts = list(dict(merged).items())
    if tls or tls_ca is not None or client_cert is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes() if tls_ca is not None else None,
            private_key=Path(client_key).read_bytes() if client_key is not None else None,
            certificate_chain=Path(client_cert).read_bytes() if client_cert is not None else None)
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, creds, options=opts)
    channel = grpc.insecure_channel(address, options=opts)
    if token is None:
        return channel
    if not (allow_insecure_token or is_loopback(address)):
        channel.close()
        raise ValueError(f"refusing to send the token in plaintext to {address}: use TLS "
                         "(or allow_insecure_token=True inside a trusted network)")
    return grpc.intercept_channel(channel, _BearerInterceptor(token))


def field_violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    """``(field, description)`` pairs of the ``google.rpc.BadRequest`` details of an RPC error
    (empty when it has none)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return []
    out = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out
