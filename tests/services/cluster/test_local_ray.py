"""The embedded local Ray: a start that times out is retried on a fresh session, then fails with
Ray's own error, and leaves no process of the failed sessions behind."""

from __future__ import annotations

from pathlib import Path

import pytest


def session_processes(session_dir: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"--session-dir={session_dir} " in cmdline + " ":
            found.append(cmdline[:120])
    return found


def test_a_local_start_that_times_out_is_retried_and_cleaned_up(monkeypatch, capsys) -> None:
    import ray

    from onpolicy.services.cluster.local_ray import GCS_WAIT_ENV, LOCAL_START_ATTEMPTS, init_ray, is_start_timeout

    assert not ray.is_initialized()
    # no wait at all for the GCS port: every start times out, for real
    monkeypatch.setenv(GCS_WAIT_ENV, "0")
    with pytest.raises(RuntimeError) as raised:
        init_ray(num_cpus=1)
    assert is_start_timeout(raised.value)
    assert not ray.is_initialized()
    err = capsys.readouterr().err
    assert err.count("onpolicy: local Ray did not start") == LOCAL_START_ATTEMPTS - 1
    failed_sessions = [line.split("Timed out waiting for file ")[1].rsplit("/", 1)[0]
                       for line in err.splitlines() if "did not start" in line]
    failed_sessions.append(str(raised.value).split("Timed out waiting for file ")[1].rsplit("/", 1)[0])
    assert len(set(failed_sessions)) == LOCAL_START_ATTEMPTS  # each attempt is a fresh session
    for session in failed_sessions:
        assert session_processes(session) == [], f"{session} left processes running"


def test_the_operator_setting_for_the_gcs_wait_wins(monkeypatch) -> None:
    import os

    from onpolicy.services.cluster.local_ray import GCS_START_WAIT_S, GCS_WAIT_ENV, ray_env

    monkeypatch.delenv(GCS_WAIT_ENV, raising=False)
    ray_env()
    assert os.environ[GCS_WAIT_ENV] == str(GCS_START_WAIT_S)
    monkeypatch.setenv(GCS_WAIT_ENV, "7")
    ray_env()
    assert os.environ[GCS_WAIT_ENV] == "7"


def test_both_ray_start_timeouts_are_retryable() -> None:
    from onpolicy.services.cluster.local_ray import is_start_timeout

    assert is_start_timeout(RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1."))
    assert is_start_timeout(Exception("The current node timed out during startup. This could happen because ..."))
    assert not is_start_timeout(RuntimeError("Address already in use"))
