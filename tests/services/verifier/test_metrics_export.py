"""Metrics plumbing: the windowed max, label bounds, the HTTP endpoint, the controller's merging hub,
and the rollout/trainer collectors."""

from __future__ import annotations

import types
import urllib.request

import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from verifier_support import KV_TILE, MODEL, parse, scrape, value

from onpolicy.kernels import KernelConfig
from onpolicy.services.common.metrics_endpoint import MetricsEndpoint, MetricsHub
from onpolicy.services.verifier.metrics import VerifierMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def metrics(job: str = "", clock=None, **kw) -> VerifierMetrics:
    return VerifierMetrics(model="m", kernel_config=KernelConfig(), job=job, clock=clock or Clock(), **kw)


def observe(vm: VerifierMetrics, job: str, diffs: list[float], kl: float = 0.0, received: float = 0.0) -> None:
    t = torch.tensor(diffs, dtype=torch.float32)
    vm.observe(job, t, int((t != 0).sum()), 1, kl, received)


def test_logdiff_max_window_keeps_at_least_the_last_batch() -> None:
    clock = Clock()
    vm = metrics(clock=clock, window_s=60)
    observe(vm, "j", [0.0, 0.5, 0.0], kl=0.3)
    clock.t += 10
    observe(vm, "j", [0.0, 0.0, 0.0])
    m = scrape(vm.registry)
    assert value(m, "onpolicy_logdiff_max", job="j") == 0.5  # both batches are in the last 60 s
    assert abs(value(m, "onpolicy_kl_k3", job="j") - 0.3 / 6) < 1e-12
    clock.t += 55  # the mismatching batch is now older than the window
    m = scrape(vm.registry)
    assert value(m, "onpolicy_logdiff_max", job="j") == 0.0 and value(m, "onpolicy_kl_k3", job="j") == 0.0
    clock.t += 1000
    observe(vm, "k", [1e-4])
    clock.t += 1000  # nothing newer: the most recent batch still counts
    m = scrape(vm.registry)
    assert value(m, "onpolicy_logdiff_max", job="k") == float(torch.tensor(1e-4))
    assert value(m, "onpolicy_logdiff_bucket", job="k", le="1e-05") == 0
    assert value(m, "onpolicy_logdiff_bucket", job="k", le="0.0001") == 1  # le: an upper bound, inclusive
    assert value(m, "onpolicy_tokens_mismatched_total", job="j") == 1


def test_lag_and_job_label_bound() -> None:
    clock = Clock()
    vm = metrics(clock=clock, max_jobs=2)
    observe(vm, "a", [0.0], received=clock.t - 5)
    clock.t += 2
    observe(vm, "b", [0.0], received=clock.t)
    observe(vm, "c", [0.0])  # a third job: folded into _other
    vm.dropped("d", "queue_full", 3)
    m = scrape(vm.registry)
    assert value(m, "onpolicy_verification_lag_seconds", job="a") == 7
    assert value(m, "onpolicy_verification_lag_seconds", job="b") == 0
    assert value(m, "onpolicy_tokens_checked_total", job="_other") == 1
    assert value(m, "onpolicy_samples_dropped_total", job="_other", reason="queue_full") == 3
    assert {dict(ls)["job"] for n, ls in m if n == "onpolicy_tokens_checked_total"} == {"a", "b", "_other"}


def get(url: str, accept: str = "text/plain") -> str:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as r:
        return r.read().decode()


def test_endpoint_serves_its_registry_on_loopback() -> None:
    vm = metrics(job="j1")
    observe(vm, "j1", [0.0, 0.0])
    ep = MetricsEndpoint(vm.registry)
    try:
        assert ep.address.startswith("127.0.0.1:") and ep.url.endswith("/metrics")
        m = parse(get(ep.url))
        assert value(m, "onpolicy_tokens_checked_total", job="j1") == 2
    finally:
        ep.close()


def test_hub_merges_targets_and_keeps_a_retired_jobs_final_snapshot() -> None:
    clock = Clock()
    a, b = metrics(job="ja"), metrics(job="jb")
    observe(a, "ja", [0.0] * 3)
    observe(b, "jb", [0.0] * 5)
    ea, eb = MetricsEndpoint(a.registry), MetricsEndpoint(b.registry)
    hub = MetricsHub(timeout_s=2, retain_s=60, clock=clock)
    hub.add_target("ja", "verifier", ea.url)
    hub.add_target("jb", "verifier", eb.url)
    hub.add_target("jc", "verifier", "http://127.0.0.1:9/metrics")  # nothing listens there
    ep = hub.serve()
    try:
        text = get(ep.url)
        assert text.count("# TYPE onpolicy_tokens_checked_total counter") == 1  # one family, merged
        m = parse(text)
        assert value(m, "onpolicy_tokens_checked_total", job="ja") == 3
        assert value(m, "onpolicy_tokens_checked_total", job="jb") == 5
        assert value(m, "onpolicy_metrics_target_up", job="ja") == 1
        assert value(m, "onpolicy_metrics_target_up", job="jc") == 0  # a dead target never fails the scrape
        # Prometheus asks for OpenMetrics: the merged families must be valid there too.
        om = get(ep.url, "application/openmetrics-text; version=1.0.0")
        names = {f.name for f in parse_openmetrics(om)}
        assert {"onpolicy_logdiff", "onpolicy_tokens_checked", "onpolicy_weight_version"} <= names

        observe(a, "ja", [0.0] * 4)
        hub.retire("ja")  # the job ended: final scrape, then its service goes away
        ea.close()
        m = parse(get(ep.url))
        assert value(m, "onpolicy_tokens_checked_total", job="ja") == 7  # the final values stay
        assert ("onpolicy_metrics_target_up", frozenset({"job": "ja", "role": "verifier"}.items())) not in m
        clock.t += 61
        assert ("onpolicy_tokens_checked_total", frozenset({"job": "ja", "model": "m", "role": "verifier"}.items())) \
            not in parse(get(ep.url))
    finally:
        ep.close()
        eb.close()
        hub.close()


def test_rollout_and_trainer_collectors(load_tiny) -> None:
    from onpolicy.rollout import RolloutEngine, SamplingParams
    from onpolicy.services.common.role_metrics import RolloutMetrics, TrainerMetrics
    from onpolicy.services.rollout.servicer import RolloutServicer

    sv = RolloutServicer(RolloutEngine(load_tiny(MODEL, kv_tile=KV_TILE)))
    try:
        rm = RolloutMetrics(sv, job="j")
        sv.worker.call_idle(lambda e: e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, n=2, ignore_eos=True)))
        m = scrape(rm.registry)
        lab = {"job": "j", "model": MODEL, "role": "rollout"}
        assert value(m, "onpolicy_rollout_tokens_generated_total", **lab) == 10
        assert value(m, "onpolicy_rollout_tokens_per_second", **lab) > 0
        assert value(m, "onpolicy_rollout_queue_depth", **lab) == 0
        assert value(m, "onpolicy_rollout_kv_cache_usage_ratio", **lab) == 0  # everything finished
        assert value(m, "onpolicy_weight_version", **lab) == 0
        assert value(m, "onpolicy_kernel_config_info", **lab) == 1
    finally:
        sv.close()

    engine = types.SimpleNamespace(step=0, weight_version=0, lm=types.SimpleNamespace(name=MODEL))
    resp = types.SimpleNamespace(tokens=40, seconds=0.5, tokens_per_second=80.0, loss=0.25, grad_norm=1.5,
                                 clip_fraction=0.0, old_logprob_max_abs_diff=0.0)

    def train_step(request, context):
        engine.step = engine.weight_version = engine.step + 1
        return resp

    trainer = types.SimpleNamespace(engine=engine, kernel_config=KernelConfig(), TrainStep=train_step)
    tm = TrainerMetrics(trainer, job="j")
    trainer.TrainStep(None, None)
    trainer.TrainStep(None, None)
    m = scrape(tm.registry)
    lab = {"job": "j", "model": MODEL, "role": "trainer"}
    assert value(m, "onpolicy_trainer_step", **lab) == 2 and value(m, "onpolicy_weight_version", **lab) == 2
    assert value(m, "onpolicy_trainer_tokens_total", **lab) == 80
    assert value(m, "onpolicy_trainer_step_seconds", **lab) == 0.5
    assert value(m, "onpolicy_trainer_tokens_per_second", **lab) == 80
    assert value(m, "onpolicy_trainer_loss", **lab) == 0.25
