"""HTTP/2 keepalive (``services/common/server.py``, on every channel ``connect`` makes): a stream to
a service that hangs (process stopped, its socket still open — what a lost node looks like to a
client) fails with UNAVAILABLE once a keepalive ping goes unanswered, instead of waiting forever;
without keepalive the same stream just waits (the negative control)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest

from onpolicy.services.common.client import connect
from onpolicy.services.common.server import keepalive_options

SERVER = """
import time
from concurrent.futures import ThreadPoolExecutor
import grpc
from onpolicy.services.common.server import server_keepalive_options

def ticks(request, context):  # one message, then a stream that stays open
    yield b"tick"
    time.sleep(600)

handler = grpc.method_handlers_generic_handler("test.Ticks", {"Watch": grpc.unary_stream_rpc_method_handler(ticks)})
server = grpc.server(ThreadPoolExecutor(4), handlers=[handler], options=server_keepalive_options())
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def hung_server() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{int(proc.stdout.readline())}", proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def watch_then_stop(address: str, proc: subprocess.Popen[str], options: list, wait_s: float) -> object:
    """Open a Health.Watch stream, stop the server process, and return what the stream's next read
    gives within ``wait_s`` seconds: an exception, or ``"waiting"``."""
    channel = connect(address, options=options)
    stream = channel.unary_stream("/test.Ticks/Watch")(b"")
    assert next(stream) == b"tick"
    os.kill(proc.pid, signal.SIGSTOP)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(_next_or_error(stream)), daemon=True)
    reader.start()
    reader.join(wait_s)
    result = got[0] if got else "waiting"
    stream.cancel()
    channel.close()
    return result


def _next_or_error(stream: object) -> object:
    try:
        return next(stream)  # type: ignore[call-overload]
    except grpc.RpcError as e:
        return e


def test_a_stream_to_a_hung_service_fails_once_keepalive_goes_unanswered(hung_server) -> None:
    address, proc = hung_server
    got = watch_then_stop(address, proc, keepalive_options(every_s=1.0, timeout_s=1.0), wait_s=30)
    assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.UNAVAILABLE, got


def test_without_keepalive_the_same_stream_waits(hung_server) -> None:
    address, proc = hung_server
    off = [("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.keepalive_permit_without_calls", 0)]
    assert watch_then_stop(address, proc, off, wait_s=6) == "waiting"
