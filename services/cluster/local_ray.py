"""Start or attach to Ray. A local cluster is embedded in this process and kept on loopback."""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
from pathlib import Path

# Seconds a new local cluster's GCS gets to publish its port. Ray's own default is 30 s, and a
# loaded or briefly stalled VM has missed it: in one CI run the GCS had not even opened its log
# within 30 s, twice in a row, while a minute later the same process started Ray normally.
GCS_START_WAIT_S = 120
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's own setting, read when a local GCS starts
# A local start that still times out is tried again on a fresh session directory.
LOCAL_START_ATTEMPTS = 3
# The two start-up waits of Ray 2.60 a stalled VM has missed: the GCS publishing its port (the wait
# above), and the raylet registering with the GCS (a fixed 30 s in ray/_private/node.py; in one CI run
# the raylet had not opened its log 30 s after it was spawned).
_START_TIMEOUTS = ("Timed out waiting for file", "The current node timed out during startup")


def ray_env() -> None:
    """Environment every onpolicy Ray process runs with: no usage stats; every listener of a local
    cluster on 127.0.0.1 (measured with Ray 2.60: with this variable set to 0 nothing binds other
    interfaces); a longer wait for the GCS to come up (an operator's own setting wins)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault(GCS_WAIT_ENV, str(GCS_START_WAIT_S))


def is_start_timeout(error: BaseException) -> bool:
    """True for Ray's start-up timeouts (the GCS never published its port, or the raylet never
    registered), which a retry on a fresh session can cure."""
    return any(t in str(error) for t in _START_TIMEOUTS)


def session_dirs() -> set[str]:
    """Session directories under Ray's temp root (``$RAY_TMPDIR`` or the system temp dir)."""
    root = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
    return {str(p) for p in root.glob("session_2*")}


def kill_session(error: BaseException, sessions: set[str] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """SIGKILL the processes a timed-out start left behind (Ray forgets the processes it spawned when
    ``ray.init`` fails, and they would live as long as this process): this process's children
    running for the session named in ``error`` or one of ``sessions`` (so another process's Ray on
    the same machine is never touched). Returns their pids."""
    dirs = set(sessions)
    match = re.search(r"(/\S+/session_[^/\s]+)/", str(error))
    if match:
        dirs.add(match.group(1))
    return [pid for d in sorted(dirs) for pid in _kill_marked(f"--session-dir={d} ".encode())]


def _kill_marked(marker: bytes) -> list[int]:
    killed, me = [], os.getpid()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == me and marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ") + b" ":
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return killed


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Attach to ``address`` (e.g. ``ray://…`` or ``auto``) or start an embedded local Ray on loopback.
    Returns the GCS address. Logical CPUs of a local cluster default to max(8, cores) so the three
    role actors of a job can be placed on a small machine (each sets its own thread count). A local
    start that hits one of Ray's start-up timeouts is retried (``LOCAL_START_ATTEMPTS`` in all), with
    a line on stderr; other errors propagate."""
    ray_env()
    import ray

    if ray.is_initialized():
        return str(ray.get_runtime_context().gcs_address)
    if address:
        ray.init(address=address, log_to_driver=False)
        return str(ray.get_runtime_context().gcs_address)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = session_dirs()
        try:
            # address="local": always a new cluster, never one another process left running
            ray.init(address="local", num_cpus=num_cpus or max(8, os.cpu_count() or 1),
                     include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
            break
        except Exception as e:  # Ray raises a bare Exception when the raylet never registers
            ray.shutdown()
            if is_start_timeout(e):
                kill_session(e, session_dirs() - before)
            if attempt == LOCAL_START_ATTEMPTS or not is_start_timeout(e):
                raise
            print(f"onpolicy: local Ray did not start ({e}); trying again "
                  f"({attempt + 1}/{LOCAL_START_ATTEMPTS})", file=sys.stderr, flush=True)
    return str(ray.get_runtime_context().gcs_address)


def shutdown_ray() -> None:
    """Disconnect this process from Ray (a local cluster it started goes down with it); nothing when
    Ray was never imported."""
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
