"""How `onpolicy up` / `serve` take signals: the first SIGTERM or SIGINT asks for the bounded
shutdown and puts both signals back to their default action, so a second one ends the process at
once (a real signal sent to this process)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from onpolicy.cli.up_cmd import stop_on_signal


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_first_signal_stops_and_the_next_one_is_the_default(saved_handlers: None, first: signal.Signals) -> None:
    stop = stop_on_signal()
    assert not stop.is_set()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    os.kill(os.getpid(), first)
    deadline = time.monotonic() + 10
    while not stop.is_set() and time.monotonic() < deadline:  # the handler runs between bytecodes
        time.sleep(0.01)
    assert stop.is_set()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
