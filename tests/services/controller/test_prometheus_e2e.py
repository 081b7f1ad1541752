"""A real Prometheus server scrapes the controller's one metrics endpoint during a real job (local
Ray, gRPC services, RayLauncher with a MetricsHub) and holds the verifier's numbers: the logdiff
histogram, tokens checked equal to what the job's events reported, zero mismatches, a zero
logdiff max, and the weight version equal to the steps taken — plus rollout and trainer metrics.

Needs the ``prometheus`` binary (Debian package ``prometheus``). Without it the test is skipped
with the reason — except in CI (``$CI`` set), where a missing binary is a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.controller.convert import spec_to_proto

ROOT = Path(__file__).resolve().parents[3]
TOKEN = secrets.token_urlsafe(16)
STEPS = 2
WAIT_S = 60


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if path is None:
        msg = "the prometheus binary is not installed (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}: CI must install it")
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


def start_prometheus(binary: str, target: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    config = workdir / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: onpolicy
    honor_labels: true  # keep our job label (the job id) instead of exported_job
    static_configs:
      - targets: ["{target}"]
""")
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("prometheus did not become ready in 30 s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    binary = prometheus_binary()
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray
    from onpolicy.services.common.metrics_endpoint import MetricsHub
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    work = tmp_path_factory.mktemp("prometheus")
    init_ray()
    hub = MetricsHub()
    endpoint = hub.serve("127.0.0.1", 0)
    state = work / "controller"
    controller = JobController(state, RayLauncher(token=TOKEN, metrics=hub, state_dir=state))
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    prom = None
    try:
        prom, prom_url = start_prometheus(binary, endpoint.address, work)
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
        yield stub, prom_url
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait(5)
        controller.shutdown()
        server.stop()
        endpoint.close()
        hub.close()
        shutdown_ray()


def query(prom_url: str, expr: str) -> list[tuple[dict, float]]:
    data = http_json(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert data["status"] == "success", data
    return [(r["metric"], float(r["value"][1])) for r in data["data"]["result"]]


def one(prom_url: str, expr: str) -> float:
    res = query(prom_url, expr)
    assert len(res) == 1, f"{expr}: {res}"
    return res[0][1]


def test_prometheus_scrapes_the_verifier_of_a_real_job(stack) -> None:
    stub, prom = stack
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    spec["steps"] = STEPS
    job_id = stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id
    events = [r.event for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=900)]
    assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_SUCCEEDED", events[-1]
    steps = [e for e in events if e.weight_version]
    assert [e.weight_version for e in steps] == list(range(1, STEPS + 1))
    checked = sum(e.tokens_checked for e in steps)
    assert checked > 0

    sel = f'job="{job_id}",role="verifier"'
    deadline = time.monotonic() + WAIT_S
    while True:  # the final snapshot reaches Prometheus within a scrape or two of the job's end
        tokens = query(prom, f"onpolicy_tokens_checked_total{{{sel}}}")
        version = query(prom, f"onpolicy_weight_version{{{sel}}}")
        if tokens and tokens[0][1] == checked and version and version[0][1] == STEPS:
            break
        assert time.monotonic() < deadline, f"series not in Prometheus after {WAIT_S} s: {tokens} {version}"
        time.sleep(1)

    assert one(prom, f"onpolicy_tokens_checked_total{{{sel}}}") == checked
    assert one(prom, f"onpolicy_tokens_mismatched_total{{{sel}}}") == 0
    assert one(prom, f"onpolicy_logdiff_max{{{sel}}}") == 0
    assert one(prom, f"onpolicy_weight_version{{{sel}}}") == STEPS
    buckets = {m["le"]: v for m, v in query(prom, f"onpolicy_logdiff_bucket{{{sel}}}")}
    assert buckets and buckets["0"] == checked and buckets["+Inf"] == checked  # every token bitwise equal
    assert one(prom, f"onpolicy_logdiff_count{{{sel}}}") == checked
    assert one(prom, f"onpolicy_sequences_checked_total{{{sel}}}") > 0
    assert one(prom, f"onpolicy_kl_k3{{{sel}}}") == 0
    assert one(prom, f'onpolicy_samples_dropped_total{{{sel},reason="stale_weights"}}') == 0
    assert one(prom, f"onpolicy_verification_lag_seconds{{{sel}}}") >= 0
    info = query(prom, f"onpolicy_kernel_config_info{{{sel}}}")
    assert len(info) == 1 and info[0][0]["backend"] == "reference" and info[0][0]["kv_tile"] == "64"
    # Rollout and trainer export through the same endpoint, and agree on the weight version.
    assert one(prom, f'onpolicy_rollout_tokens_generated_total{{job="{job_id}"}}') > 0
    assert one(prom, f'onpolicy_rollout_kv_cache_usage_ratio{{job="{job_id}"}}') >= 0
    assert one(prom, f'onpolicy_trainer_step{{job="{job_id}"}}') == STEPS
    assert one(prom, f'onpolicy_trainer_tokens_per_second{{job="{job_id}"}}') > 0
    versions = {m["role"]: v for m, v in query(prom, f'onpolicy_weight_version{{job="{job_id}"}}')}
    assert versions == {"rollout": STEPS, "trainer": STEPS, "verifier": STEPS}


def test_a_missing_prometheus_skips_locally_but_fails_in_ci(monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y prometheus"):
        prometheus_binary()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must install it"):
        prometheus_binary()
