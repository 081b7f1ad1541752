"""Prometheus metrics of the rollout and trainer services (the verifier's are in
``onpolicy.services.verifier.metrics``), each in a ``CollectorRegistry`` of its own, read from the
engine at scrape time. Labels ``job``, ``model``, ``role``; both also export the cross-role
``onpolicy_weight_version`` and ``onpolicy_kernel_config_info`` (``role`` tells the three apart, so
a weight-version or kernel skew between rollout, trainer and verifier is one query).

Rollout (``role="rollout"``):

====================================================  =======  ======================================
``onpolicy_rollout_tokens_generated_total``           counter  sampled tokens
``onpolicy_rollout_tokens_computed_total``            counter  token rows computed (prefill + decode)
``onpolicy_rollout_steps_total``                      counter  engine steps
``onpolicy_rollout_busy_seconds_total``               counter  seconds spent in engine steps
``onpolicy_rollout_tokens_per_second``                gauge    generated tokens per busy second
                                                               (wall-clock: ``rate(…_generated_total)``)
``onpolicy_rollout_queue_depth``                      gauge    sequences waiting for admission
``onpolicy_rollout_running_sequences``                gauge    sequences in the running batch
``onpolicy_rollout_kv_cache_usage_ratio``             gauge    KV pages held by sequences / all pages
``onpolicy_rollout_prefix_cache_hits_total``          counter  KV pages reused from the prefix cache
``onpolicy_rollout_preemptions_total``                counter  sequences preempted for KV space
``onpolicy_rollout_spec_drafted_tokens_total``        counter  tokens drafted by speculative decoding
``onpolicy_rollout_spec_accepted_tokens_total``       counter  drafted tokens accepted (decode steps saved)
``onpolicy_rollout_admitted_token_positions``         gauge    token positions admitted by the gate
``onpolicy_rollout_queued_requests``                  gauge    Generate calls queued at the gate
``onpolicy_rollout_rejected_requests_total``          counter  calls refused RESOURCE_EXHAUSTED
``onpolicy_rollout_aborted_sequences_total``          counter  sequences aborted (client went away)
====================================================  =======  ======================================

Trainer (``role="trainer"``; the last TrainStep's numbers, recorded by wrapping the servicer's
``TrainStep`` before it is registered with the gRPC server):

====================================================  =======  ======================================
``onpolicy_trainer_step``                             gauge    optimizer steps taken
``onpolicy_trainer_step_seconds``                     gauge    duration of the last step
``onpolicy_trainer_tokens_per_second``                gauge    tokens/s of the last step
``onpolicy_trainer_tokens_total``                     counter  tokens trained on
``onpolicy_trainer_loss`` / ``_grad_norm`` /          gauge    of the last step
``_clip_fraction`` / ``_old_logprob_max_abs_diff``
``onpolicy_trainer_entropy``                          gauge    token-mean policy entropy, last step
``onpolicy_trainer_correction_fraction``              gauge    tokens truncated (TIS) or masked (MIS)
                                                               by the rollout correction, last step
``onpolicy_trainer_correction_ratio``                 histo-   rollout -> trainer importance weights
                                                      gram     of every corrected step (per token, or
                                                               per sequence at level sequence)
====================================================  =======  ======================================
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..verifier.metrics import BASE_LABELS, kernel_info_family, weight_version_family
from .labels import model_label


def _family(kind: str, name: str, doc: str, labels: list[str], value: float) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    fam = cls(name, doc, labels=list(BASE_LABELS))
    fam.add_metric(labels, float(value))
    return fam


class RolloutMetrics:
    """Collector over a ``RolloutServicer``'s engine (plain reads of counters the engine keeps)."""

    def __init__(self, servicer: Any, job: str = "") -> None:
        self.servicer = servicer
        self.labels = (job, model_label(servicer.lm.name), "rollout")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        engine = self.servicer.engine
        st = engine.stats()
        lab = list(self.labels)
        p = "onpolicy_rollout_"
        yield _family("counter", p + "tokens_generated", "Sampled tokens", lab, st.tokens_generated)
        yield _family("counter", p + "tokens_computed", "Token rows computed (prefill + decode)", lab,
                      st.tokens_computed)
        yield _family("counter", p + "steps", "Engine steps", lab, st.steps)
        yield _family("counter", p + "busy_seconds", "Seconds spent in engine steps", lab, st.seconds)
        yield _family("gauge", p + "tokens_per_second", "Generated tokens per busy second", lab,
                      st.tokens_generated / st.seconds if st.seconds > 0 else 0.0)
        yield _family("gauge", p + "queue_depth", "Sequences waiting for admission", lab, st.waiting)
        yield _family("gauge", p + "running_sequences", "Sequences in the running batch", lab, st.running)
        yield _family("gauge", p + "kv_cache_usage_ratio", "KV cache pages held by sequences / all pages", lab,
                      st.kv_usage)
        yield _family("counter", p + "prefix_cache_hits", "KV pages reused from the prefix cache", lab,
                      st.prefix_cache_hits)
        yield _family("counter", p + "preemptions", "Sequences preempted for KV space", lab, st.preemptions)
        yield _family("counter", p + "spec_drafted_tokens", "Tokens drafted by speculative decoding", lab,
                      st.spec_drafted)
        yield _family("counter", p + "spec_accepted_tokens", "Drafted tokens accepted (decode steps saved)", lab,
                      st.spec_accepted)
        gate = getattr(self.servicer, "admission", None)  # services/rollout/admission.py
        if gate is not None:
            yield _family("gauge", p + "admitted_token_positions", "Token positions admitted by the gate", lab,
                          gate.inflight_tokens)
            yield _family("gauge", p + "queued_requests", "Generate calls queued at the gate", lab, gate.queued)
            yield _family("counter", p + "rejected_requests", "Calls refused RESOURCE_EXHAUSTED by the gate", lab,
                          gate.stats.rejected)
            yield _family("counter", p + "aborted_sequences", "Sequences aborted because their client went away",
                          lab, self.servicer.worker.aborted_sequences)
        yield weight_version_family(self.labels, engine.weight_version)
        yield kernel_info_family(self.labels, self.servicer.kernel_config)


class _RatioHistogram:
    """The rollout-correction weights of every TrainStep so far (``TrainStepResponse``'s per-bucket
    counts, summed; cumulative per Prometheus histogram convention)."""

    def __init__(self) -> None:
        self.bounds: list[float] = []
        self.counts: list[int] = []
        self.sum = 0.0

    def add(self, resp: Any) -> None:
        counts = list(getattr(resp, "correction_ratio_counts", ()))
        if not sum(counts):
            return
        bounds = list(resp.correction_ratio_bounds)
        if bounds != self.bounds:  # the first corrected step (or a trainer with other buckets)
            self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.sum += resp.correction_ratio_sum

    def family(self, name: str, labels: list[str]) -> Metric:
        fam = HistogramMetricFamily(name, "Rollout -> trainer importance weights of the rollout correction",
                                    labels=list(BASE_LABELS))
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts or [0], strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        fam.add_metric(labels, buckets, sum_value=self.sum)
        return fam


class TrainerMetrics:
    """Collector over a ``TrainerServicer``; wraps its ``TrainStep`` to record each step's numbers
    (so build it before the servicer is registered with a gRPC server)."""

    def __init__(self, servicer: Any, job: str = "") -> None:
        self.servicer = servicer
        self.labels = (job, model_label(servicer.engine.lm.name), "trainer")
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._tokens = 0
        self._ratio = _RatioHistogram()
        step = servicer.TrainStep

        @functools.wraps(step)
        def train_step(request: Any, context: Any) -> Any:
            resp = step(request, context)
            with self._lock:
                self._tokens += resp.tokens
                self._last = {"step_seconds": resp.seconds, "tokens_per_second": resp.tokens_per_second,
                              "loss": resp.loss, "grad_norm": resp.grad_norm, "clip_fraction": resp.clip_fraction,
                              "old_logprob_max_abs_diff": resp.old_logprob_max_abs_diff,
                              "entropy": getattr(resp, "entropy", 0.0),
                              "correction_fraction": getattr(resp, "correction_fraction", 0.0)}
                self._ratio.add(resp)
            return resp

        servicer.TrainStep = train_step
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        lab = list(self.labels)
        p = "onpolicy_trainer_"
        with self._lock:
            last, tokens = dict(self._last), self._tokens
        step = self.servicer.engine.step
        yield _family("gauge", p + "step", "Optimizer steps taken", lab, step)
        yield _family("counter", p + "tokens", "Tokens trained on", lab, tokens)
        docs = {"step_seconds": "Duration of the last training step", "tokens_per_second": "Tokens/s of the last step",
                "loss": "Loss of the last step", "grad_norm": "Gradient norm of the last step (before clipping)",
                "clip_fraction": "Fraction of tokens clipped in the last step",
                "old_logprob_max_abs_diff": "Max |old - recomputed logprob| of the last step (0 when on-policy)",
                "entropy": "Token-mean entropy of the policy on the sampled positions in the last step",
                "correction_fraction": "Fraction of tokens truncated (TIS) or masked (MIS) by the rollout "
                                       "correction in the last step"}
        for key, doc in docs.items():
            yield _family("gauge", p + key, doc, lab, last.get(key, 0.0))
        with self._lock:
            yield self._ratio.family(p + "correction_ratio", lab)
        yield weight_version_family(self.labels, self.servicer.engine.weight_version)
        yield kernel_info_family(self.labels, self.servicer.kernel_config)
