"""``onpolicy consistency`` parallel degrees: bad values exit 2 with a one-line message naming the
flag, before any worker process starts (the multi-process runs are in test_tp_ep_invariance)."""

from __future__ import annotations

import pytest

from onpolicy.cli.main import main


@pytest.mark.parametrize(("model", "flags", "message"), [
    ("tiny-qwen3", ["--trainer-tp", "3"], "--trainer-tp must be a power of two from 1 to 8, got 3"),
    ("tiny-qwen3", ["--rollout-tp", "0"], "--rollout-tp must be a power of two from 1 to 8, got 0"),
    ("tiny-qwen3", ["--trainer-tp", "8"], "tp=8 must divide the canonical reduce_chunks=4"),
    ("tiny-qwen3", ["--rollout-ep", "2"], "ep=2 needs a mixture-of-experts model"),
    ("tiny-qwen3-moe", ["--trainer-ep", "16"], "--trainer-ep must be a power of two from 1 to 8, got 16"),
])
def test_bad_degrees_exit_2(capsys: pytest.CaptureFixture[str], model: str, flags: list[str], message: str) -> None:
    assert main(["consistency", "--model", model, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
