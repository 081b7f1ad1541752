"""Bearer-token authentication of every RPC except health checks and reflection, and the per-job
tokens of role services (``new_role_token``).

With a token configured, a call must carry metadata ``authorization: Bearer <token>``; anything
else is refused with UNAUTHENTICATED before the servicer runs. The comparison is constant-time
(``hmac.compare_digest``) and the token never appears in logs, reprs or status messages.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from .errors import rewrap

TOKEN_ENV = "ONPOLICY_TOKEN"
AUTH_HEADER = "authorization"
#: The largest token file read (a token is tens of bytes).
MAX_TOKEN_BYTES = 64 << 10
#: Method prefixes that answer without a token: probes (kubelet, load balancers) and reflection.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def load_token(path: str | os.PathLike[str] | None = None, env: str = TOKEN_ENV) -> str | None:
    """The shared token: the file at ``path`` if given (a mounted Kubernetes Secret), else the
    environment variable ``env``; ``None`` when neither is set (authentication off)."""
    if path is not None:
        with open(Path(path), "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
        if len(raw) > MAX_TOKEN_BYTES:
            raise ValueError(f"token file {path} is larger than {MAX_TOKEN_BYTES >> 10} KiB")
        token = raw.decode().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    return os.environ.get(env, "").strip() or None


def new_role_token() -> str:
    """A fresh token for one job's role services (256 bits): the controller makes one per launch and
    keeps it in memory only, so a job's token drives that job's services and no other's."""
    return secrets.token_urlsafe(32)


def bearer(token: str) -> tuple[str, str]:
    """The metadata entry that authenticates a call."""
    return AUTH_HEADER, f"Bearer {token}"


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def __repr__(self) -> str:
        return "TokenAuthInterceptor(token=<redacted>)"

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES) or self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: refuse without telling whether it exists
            handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
        return rewrap(handler, _refuse)


def _refuse(kind: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    return refuse
