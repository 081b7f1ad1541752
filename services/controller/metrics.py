"""Metrics only the job controller knows (each job's state, step, and its last step's reward, loss,
gradient norm, clip fraction, entropy, KL and eval accuracy), collected at scrape time from the
controller's records and served on the controller's aggregate ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from ..common.labels import model_label
from .controller import JobController
from .records import JobState


class ControllerMetrics:
    def __init__(self, controller: JobController) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Any]:
        labels = ["job", "model"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"onpolicy_job_{name}", doc, labels=labels)

        per_step = {  # gauge name -> (description, the last step event's field)
            "reward_mean": ("mean reward of the job's last step", "reward_mean"),
            "reward_std": ("reward std of the job's last step", "reward_std"),
            "step_seconds": ("wall time of the job's last step", None),
            "loss": ("policy loss of the job's last step", "loss"),
            "grad_norm": ("gradient norm (before clipping) of the job's last step", "grad_norm"),
            "clip_fraction": ("fraction of tokens the PPO clip bound in the job's last step", "clip_fraction"),
            "entropy": ("mean token entropy of the policy in the job's last step", "entropy"),
            "kl_k3": ("rollout-trainer K3 KL the verifier measured in the job's last step", "kl_k3"),
        }
        gauges = {name: gauge(name, doc) for name, (doc, _) in per_step.items()}
        step = gauge("step", "completed steps of the job")
        accuracy = gauge("eval_accuracy", "the job's latest eval accuracy (greedy, held-out split)")
        state = GaugeMetricFamily("onpolicy_job_state", "1 for the job's current state", labels=[*labels, "state"])
        for rec in self.controller.list():
            key = [rec.job_id, model_label(str(rec.spec.get("model", "")))]
            step.add_metric(key, rec.step)
            for s in JobState:
                state.add_metric([*key, s.value.lower()], 1.0 if rec.state is s else 0.0)
            if rec.eval_accuracy is not None:
                accuracy.add_metric(key, rec.eval_accuracy)
            ev = rec.last_event
            if ev is not None:
                for name, (_, attr) in per_step.items():
                    gauges[name].add_metric(key, ev.times.total_s if attr is None else getattr(ev, attr))
        yield from (*gauges.values(), step, accuracy, state)
