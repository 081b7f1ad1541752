"""`onpolicy up`, `submit --watch --json`, `jobs`, `watch`, `cancel` as a user runs them (subprocesses,
real gRPC, real local Ray on loopback), including a controller restart that resumes a job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "onpolicy.cli.main"]


class Up:
    """``onpolicy up`` as a subprocess; its stderr goes to a file (an unread pipe could fill and block
    it), shown when it fails to start or to stop."""

    def __init__(self, state: Path, token_file: Path) -> None:
        self.log = state.parent / f"up-{time.monotonic_ns()}.stderr"
        with self.log.open("w") as err:
            self.proc = subprocess.Popen([*CLI, "up", "--port", "0", "--state-dir", str(state), "--token-file",
                                          str(token_file)], stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.time() + 180
        self.address = ""
        while time.time() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"up exited: {self.log.read_text()}")
            if line.startswith("jobs endpoint: "):
                self.address = line.split(": ", 1)[1].strip()
                break
        assert self.address.startswith("127.0.0.1:")

    def stop(self) -> None:
        """SIGTERM, then the exit status must be 0 (``up`` bounds its own shutdown: past its deadline
        it prints every thread's stack and exits 1)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"up did not stop: {self.log.read_text()[-8000:]}") from None
        assert code == 0, f"up exited {code}: {self.log.read_text()[-8000:]}"


def run(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args}: exit {p.returncode}: {p.stderr}")
    return p


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "token"
    f.write_text("cli-test-token\n")
    return f


def test_submit_watch_jobs_and_errors(tmp_path: Path, token_file: Path) -> None:
    up = Up(tmp_path / "state", token_file)
    try:
        conn = ["--address", up.address, "--token-file", str(token_file)]
        out = run("submit", str(ROOT / "examples/jobs/tiny.yaml"), "--watch", "--json", *conn)
        events = [json.loads(line) for line in out.stdout.splitlines()]
        steps = [e for e in events if e["weight_version"] != "0"]
        for key in ("job_id", "step", "state", "reward_mean", "logdiff_max", "tokens_checked",
                    "tokens_mismatched", "weight_version"):
            assert all(key in e for e in events), key
        assert [e["step"] for e in steps] == [1, 2, 3]
        assert all(e["logdiff_max"] == 0 and int(e["tokens_checked"]) > 0 and e["tokens_mismatched"] == "0"
                   for e in steps)
        assert events[-1]["state"] == "JOB_STATE_SUCCEEDED"
        job_id = events[0]["job_id"]
        listed = json.loads(run("jobs", "--json", *conn).stdout)
        assert [(j["job_id"], j["state"], j["step"]) for j in listed] == [(job_id, "SUCCEEDED", 3)]
        replay = run("watch", job_id, "--json", *conn).stdout.splitlines()
        assert [json.loads(x) for x in replay] == events  # the full history streams again
        human = run("watch", job_id, *conn).stdout
        assert "step 3/3" not in human and "step 3 " in human and "logdiff_max 0" in human
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: tiny-qwen3\ngrpo:\n  lr: -1\n  group_size: 1\n")
        p = run("submit", str(bad), *conn, check=False)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
        assert "grpo.lr" in p.stderr and "grpo.group_size" in p.stderr
        p = run("watch", "nope", *conn, check=False)
        assert p.returncode == 2 and "NOT_FOUND" in p.stderr and "Traceback" not in p.stderr
        p = run("jobs", "--address", up.address, check=False)
        assert p.returncode == 2 and "UNAUTHENTICATED" in p.stderr
        p = run("cancel", job_id, *conn)
        assert "SUCCEEDED" in p.stdout  # a finished job stays finished
    finally:
        up.stop()


def test_restarted_controller_resumes_an_unfinished_job(tmp_path: Path, token_file: Path) -> None:
    state = tmp_path / "state"
    up = Up(state, token_file)
    conn = ["--address", up.address, "--token-file", str(token_file)]
    spec = tmp_path / "long.yaml"
    spec.write_text((ROOT / "examples/jobs/tiny.yaml").read_text().replace("steps: 3", "steps: 40"))
    try:
        job_id = run("submit", str(spec), "--json", *conn).stdout
        job_id = json.loads(job_id)["job_id"]
        deadline = time.time() + 300
        while time.time() < deadline:
            jobs = json.loads(run("jobs", "--json", *conn).stdout)
            if jobs[0]["step"] >= 1:
                break
            time.sleep(1)
        assert jobs[0]["step"] >= 1 and jobs[0]["state"] == "RUNNING"
    finally:
        up.stop()
    record = json.loads((state / "jobs" / job_id / "job.json").read_text())
    assert record["state"] == "RUNNING"  # a stopping controller leaves its jobs resumable
    up = Up(state, token_file)
    conn = ["--address", up.address, "--token-file", str(token_file)]
    try:
        out = run("watch", job_id, "--json", *conn)
        events = [json.loads(line) for line in out.stdout.splitlines()]
        assert events[-1]["state"] == "JOB_STATE_SUCCEEDED"
        assert json.loads(run("jobs", "--json", *conn).stdout)[0]["step"] == 40
        assert any("controller restarted" in e["message"] for e in events)
    finally:
        up.stop()
