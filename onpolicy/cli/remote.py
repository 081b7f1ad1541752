"""Client-side plumbing shared by the commands that talk to a running JobService."""

from __future__ import annotations

import argparse
import os
from typing import Any

import grpc

from .common import fail, read_file_arg

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("ONPOLICY_ADDRESS", DEFAULT_ADDRESS),
                   help=f"JobService address (default $ONPOLICY_ADDRESS or {DEFAULT_ADDRESS})")
    p.add_argument("--token-file", help="file holding the bearer token (default: $ONPOLICY_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate to verify a TLS server")


def read_token(path: str | None) -> str | None:
    if path:
        try:
            token = read_file_arg(path, "--token-file").decode().strip()
        except UnicodeDecodeError:
            fail(f"--token-file {path}: not text")
        if not token:
            fail(f"--token-file {path}: the file is empty")
        return token
    return os.environ.get("ONPOLICY_TOKEN") or None


def job_stub(args: argparse.Namespace) -> Any:
    from onpolicy.services import api
    from onpolicy.services.common.client import connect

    tls_ca = read_file_arg(args.tls_ca, "--tls-ca") if getattr(args, "tls_ca", None) else None
    channel = connect(args.address, token=read_token(args.token_file), tls_ca=tls_ca)
    return api.jobs_pb2_grpc.JobServiceStub(channel)


def rpc_error(e: grpc.RpcError, address: str) -> str:
    """One line for a failed call, naming the bad fields of an INVALID_ARGUMENT."""
    from onpolicy.services.common.client import field_violations

    code = e.code() if hasattr(e, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the job service at {address} (is `onpolicy up` running?)"
    violations = field_violations(e)
    if violations:
        return "invalid job spec: " + "; ".join(f"{f}: {d}" for f, d in violations)
    name = code.name if code is not None else "ERROR"
    return f"{name}: {e.details() if hasattr(e, 'details') else e}"
