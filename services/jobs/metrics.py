"""Metrics only the job controller knows (reward, step, state of each job), collected at scrape
time from the controller's records and served on the controller's aggregate ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from .controller import JobController
from .records import JobState


class ControllerMetrics:
    def __init__(self, controller: JobController) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Any]:
        labels = ["job", "model"]
        reward = GaugeMetricFamily("onpolicy_job_reward_mean", "mean reward of the job's last step", labels=labels)
        reward_std = GaugeMetricFamily("onpolicy_job_reward_std", "reward std of the job's last step", labels=labels)
        step = GaugeMetricFamily("onpolicy_job_step", "completed steps of the job", labels=labels)
        step_s = GaugeMetricFamily("onpolicy_job_step_seconds", "wall time of the job's last step", labels=labels)
        state = GaugeMetricFamily("onpolicy_job_state", "1 for the job's current state", labels=[*labels, "state"])
        for rec in self.controller.list():
            key = [rec.job_id, str(rec.spec.get("model", ""))]
            step.add_metric(key, rec.step)
            for s in JobState:
                state.add_metric([*key, s.value.lower()], 1.0 if rec.state is s else 0.0)
            if rec.last_event is not None:
                reward.add_metric(key, rec.last_event.reward_mean)
                reward_std.add_metric(key, rec.last_event.reward_std)
                step_s.add_metric(key, rec.last_event.times.total_s)
        yield from (reward, reward_std, step, step_s, state)
