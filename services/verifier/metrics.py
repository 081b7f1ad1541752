"""``VerifierMetrics``: the verifier's Prometheus metrics, in a registry of its own (the
``onpolicy.verification.sink.VerificationSink`` the verifier service hands its ``Verifier``).

Each verifier owns a ``prometheus_client.CollectorRegistry`` (never the global one), so several
verifiers in one process do not collide; ``registry`` is what an HTTP exporter serves. Values are
kept here as plain numbers and turned into metric families at scrape time (one custom collector),
which makes the per-token histogram cheap (``torch.bucketize`` per batch, not one ``observe`` per
token) and lets time-dependent gauges be computed when scraped.

Labels are low-cardinality: ``job`` (the sample's job id; after ``max_jobs`` distinct ids further
jobs are folded into ``job="_other"``), ``model``, ``role`` (``verifier``), plus ``reason`` on
drops and the kernel constants on the info gauge. Per-sample metrics carry the job of the samples;
service-level gauges (weight version, kernel config, queue) carry the job the verifier was started
for ("" for a shared verifier). Prometheus attaches its own ``job`` label to every target: scrape
with ``honor_labels: true`` (ServiceMonitor ``honorLabels: true``) or ours arrives as ``exported_job``.

=========================================  =========  =================================================
metric                                     type       meaning
=========================================  =========  =================================================
``onpolicy_logdiff``                       histogram  per-token ``|logp_rollout - logp_trainer|``; the
                                                      first bucket ``le="0"`` holds the exact zeros
``onpolicy_logdiff_max``                   gauge      max per-token |logdiff| over the WINDOW (below)
``onpolicy_kl_k3``                         gauge      token-mean k3 estimate of KL(rollout||trainer)
                                                      over the WINDOW
``onpolicy_tokens_checked_total``          counter    tokens recomputed
``onpolicy_tokens_mismatched_total``       counter    tokens whose two logprobs are not bitwise equal
``onpolicy_sequences_checked_total``       counter    sequences recomputed
``onpolicy_verification_lag_seconds``      gauge      now − receive time of the newest verified sample
``onpolicy_samples_dropped_total``         counter    samples not verified, by ``reason``:
                                                      ``queue_full``, ``rate_limit``, ``stale_weights``,
                                                      ``error`` (a recompute that raised)
``onpolicy_weight_version``                gauge      weight version loaded (0 = base weights)
``onpolicy_kernel_config_info``            gauge      1, labelled fingerprint/backend/kv_tile/dtype
``onpolicy_verifier_queue_samples``        gauge      samples waiting in the asynchronous queue
``onpolicy_verifier_recompute_batches_total`` counter  training-path recomputes (each drains ≥ 1 batch)
=========================================  =========  =================================================

WINDOW: ``onpolicy_logdiff_max`` and ``onpolicy_kl_k3`` cover the batches verified during the last
``window_s`` seconds (default 60 s, ``VerifierConfig.logdiff_max_window_s``) **and always at least
the most recent batch** of the job — a mismatch stays visible until newer clean batches have been
verified and it has aged out, so an alert on ``onpolicy_logdiff_max > 0`` never clears merely
because verification paused. For the GRPO loop (one verified batch per step) that is "the last step,
or every step of the last minute".

The Completion proto carries no timestamp, so the lag uses the time the verifier *received* the
sample (``VerifySample.received_at``), which for the GRPO loop is the moment its rollout finished.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from onpolicy.kernels import KernelConfig

LOGDIFF_BUCKETS = (0.0, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
"""Upper bounds (``le``) of the logdiff histogram, before ``+Inf``; the first holds exact zeros."""
_BOUNDS = torch.tensor(LOGDIFF_BUCKETS, dtype=torch.float32)
BASE_LABELS = ("job", "model", "role")
OTHER_JOB = "_other"
DROP_REASONS = ("queue_full", "rate_limit", "stale_weights")
"""Reasons exported (at 0) for every job seen; ``error`` appears only once it happens."""


def le_label(bound: float) -> str:
    """Prometheus' spelling of a bucket bound (Go's ``%g``: ``0``, ``1e-08``, ``0.1``, ``+Inf``)."""
    return "0" if bound == 0 else floatToGoString(bound)


def kernel_info_family(labels: tuple[str, str, str], cfg: KernelConfig) -> GaugeMetricFamily:
    """``onpolicy_kernel_config_info`` = 1 for one service (shared by every role's exporter)."""
    g = GaugeMetricFamily("onpolicy_kernel_config_info", "Kernel configuration of the service (value 1)",
                          labels=[*BASE_LABELS, "fingerprint", "backend", "kv_tile", "dtype"])
    g.add_metric([*labels, cfg.fingerprint, cfg.backend, str(cfg.kv_tile), cfg.compute_dtype], 1.0)
    return g


def weight_version_family(labels: tuple[str, str, str], version: int) -> GaugeMetricFamily:
    """``onpolicy_weight_version`` of one service (every role exports it; ``role`` tells them apart)."""
    g = GaugeMetricFamily("onpolicy_weight_version", "Weight version the service holds (0 = base weights)",
                          labels=list(BASE_LABELS))
    g.add_metric(list(labels), float(version))
    return g


@dataclass
class _Window:
    at: float
    max_abs: float
    tokens: int
    kl_sum: float


@dataclass
class _JobSeries:
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LOGDIFF_BUCKETS) + 1))
    diff_sum: float = 0.0
    tokens: int = 0
    mismatched: int = 0
    sequences: int = 0
    newest_received: float = 0.0
    window: deque[_Window] = field(default_factory=deque)


class VerifierMetrics:
    """Thread-safe accounting of what a verifier checked, exposed through ``registry``."""

    def __init__(self, *, model: str, kernel_config: KernelConfig, job: str = "", role: str = "verifier",
                 window_s: float = 60.0, max_jobs: int = 64, clock: Callable[[], float] = time.time) -> None:
        self.model, self.role, self.job = model, role, job
        self.kernel_config = kernel_config
        self.window_s, self.max_jobs, self.clock = window_s, max_jobs, clock
        self.weight_version = 0
        self.queue_depth: Callable[[], int] = lambda: 0
        self.recompute_batches = 0
        self._series: dict[str, _JobSeries] = {}
        self._jobs: set[str] = set()
        self._dropped: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- recording ------------------------------------------------------------------------------
    def _job(self, job: str) -> str:
        """The label value for ``job`` (caller holds the lock)."""
        if job in self._jobs:
            return job
        if len(self._jobs) < self.max_jobs:
            self._jobs.add(job)
            return job
        return OTHER_JOB

    def observe(self, job: str, diffs: torch.Tensor, mismatched: int, sequences: int, kl_sum: float,
                newest_received: float) -> None:
        """Account one verified batch of ``job``: ``diffs`` = every token's |logdiff| (fp32);
        ``newest_received`` = receive time of its newest sample (0: unknown, taken as now)."""
        diffs = diffs.detach().float().reshape(-1)
        idx = torch.bucketize(diffs.nan_to_num(nan=math.inf), _BOUNDS)  # first bound >= x (le semantics)
        counts = torch.bincount(idx, minlength=len(LOGDIFF_BUCKETS) + 1).tolist()
        max_abs = float(diffs.max()) if diffs.numel() else 0.0
        now = self.clock()
        with self._lock:
            s = self._series.setdefault(self._job(job), _JobSeries())
            s.buckets = [a + b for a, b in zip(s.buckets, counts, strict=True)]
            s.diff_sum += float(diffs.double().sum())
            s.tokens += diffs.numel()
            s.mismatched += mismatched
            s.sequences += sequences
            s.newest_received = max(s.newest_received, newest_received if newest_received > 0 else now)
            s.window.append(_Window(now, max_abs, diffs.numel(), kl_sum))
            self._prune(s, now)

    def dropped(self, job: str, reason: str, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            key = (self._job(job), reason)
            self._dropped[key] = self._dropped.get(key, 0) + n

    def recomputed(self) -> None:
        with self._lock:
            self.recompute_batches += 1

    def _prune(self, s: _JobSeries, now: float) -> None:
        while len(s.window) > 1 and s.window[0].at < now - self.window_s:
            s.window.popleft()

    # ---- reading --------------------------------------------------------------------------------
    def window_max(self, job: str) -> float:
        with self._lock:
            s = self._series.get(job)
            if s is None:
                return 0.0
            self._prune(s, self.clock())
            return max(w.max_abs for w in s.window)

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        base = [self.model, self.role]
        hist = HistogramMetricFamily("onpolicy_logdiff", "Per-token |logp_rollout - logp_trainer| "
                                     "(le=0: bitwise equal)", labels=list(BASE_LABELS))
        mx = GaugeMetricFamily("onpolicy_logdiff_max", f"Max per-token |logdiff| over the last {self.window_s:g} s "
                               "of verified batches (at least the most recent batch)", labels=list(BASE_LABELS))
        kl = GaugeMetricFamily("onpolicy_kl_k3", "Token-mean k3 KL(rollout||trainer) over the same window as "
                               "onpolicy_logdiff_max", labels=list(BASE_LABELS))
        checked = CounterMetricFamily("onpolicy_tokens_checked", "Tokens recomputed on the training path",
                                      labels=list(BASE_LABELS))
        mism = CounterMetricFamily("onpolicy_tokens_mismatched", "Tokens whose logprobs are not bitwise equal",
                                   labels=list(BASE_LABELS))
        seqs = CounterMetricFamily("onpolicy_sequences_checked", "Sequences recomputed on the training path",
                                   labels=list(BASE_LABELS))
        lag = GaugeMetricFamily("onpolicy_verification_lag_seconds", "Seconds since the newest verified sample "
                                "was received", labels=list(BASE_LABELS))
        drop = CounterMetricFamily("onpolicy_samples_dropped", "Samples not verified, by reason",
                                   labels=[*BASE_LABELS, "reason"])
        with self._lock:
            for job, s in sorted(self._series.items()):
                labels = [job, *base]
                self._prune(s, now)
                cum, buckets = 0, []
                for bound, n in zip((*LOGDIFF_BUCKETS, math.inf), s.buckets, strict=True):
                    cum += n
                    buckets.append((le_label(bound), cum))
                hist.add_metric(labels, buckets, s.diff_sum)
                mx.add_metric(labels, max(w.max_abs for w in s.window))
                wt = sum(w.tokens for w in s.window)
                kl.add_metric(labels, sum(w.kl_sum for w in s.window) / wt if wt else 0.0)
                checked.add_metric(labels, s.tokens)
                mism.add_metric(labels, s.mismatched)
                seqs.add_metric(labels, s.sequences)
                lag.add_metric(labels, max(0.0, now - s.newest_received))
            dropped = {(job, reason): 0 for job in self._jobs for reason in DROP_REASONS}  # series start at 0
            dropped.update(self._dropped)
            for (job, reason), n in sorted(dropped.items()):
                drop.add_metric([job, *base, reason], n)
            recomputes = self.recompute_batches
        svc = (self.job, self.model, self.role)
        queue = GaugeMetricFamily("onpolicy_verifier_queue_samples", "Samples waiting in the asynchronous queue",
                                  labels=list(BASE_LABELS))
        queue.add_metric(list(svc), float(self.queue_depth()))
        batches = CounterMetricFamily("onpolicy_verifier_recompute_batches", "Training-path recomputes",
                                      labels=list(BASE_LABELS))
        batches.add_metric(list(svc), recomputes)
        yield from (hist, mx, kl, checked, mism, seqs, lag, drop)
        yield weight_version_family(svc, self.weight_version)
        yield kernel_info_family(svc, self.kernel_config)
        yield from (queue, batches)
