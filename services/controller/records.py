"""The controller's typed records: job states, step events, and the persisted job record."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass
class StepTimes:
    generate_s: float = 0.0
    reward_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


@dataclass
class JobEvent:
    job_id: str
    step: int
    state: JobState
    reward_mean: float = 0.0
    reward_std: float = 0.0
    logdiff_max: float = 0.0
    tokens_checked: int = 0
    tokens_mismatched: int = 0
    rollout_tokens_per_s: float = 0.0
    trainer_tokens_per_s: float = 0.0
    weight_version: int = 0
    loss: float = 0.0
    kl_k3: float = 0.0
    times: StepTimes = field(default_factory=StepTimes)
    message: str = ""
    timestamp: float = field(default_factory=time.time)
    eval_accuracy: float | None = None
    """Mean eval reward of the greedy completions of the held-out split (None: not scored this step)."""
    eval_problems: int = 0
    grad_norm: float = 0.0
    logdiff_mean: float = 0.0
    clip_fraction: float = 0.0
    entropy: float = 0.0
    correction_fraction: float = 0.0
    """Fraction of tokens whose rollout-correction weight was truncated (tis) or masked (mis)."""
    groups_dropped: int = 0
    """Dynamic sampling: groups with all-equal rewards drawn this step and not trained on."""
    lr: float = 0.0
    """The learning rate the step trained with (after warmup and schedule)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobEvent:
        d = dict(d)
        d["state"] = JobState(d["state"])
        d["times"] = StepTimes(**d.get("times", {}))
        return cls(**d)


@dataclass
class JobRecord:
    job_id: str
    spec: dict[str, Any]
    state: JobState = JobState.PENDING
    step: int = 0
    """Completed steps."""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    error: str = ""
    last_event: JobEvent | None = None
    eval_accuracy: float | None = None
    """The latest eval accuracy (None before the first eval)."""

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "spec": self.spec, "state": self.state.value, "step": self.step,
                "created_at": self.created_at, "updated_at": self.updated_at, "error": self.error,
                "last_event": self.last_event.to_dict() if self.last_event else None,
                "eval_accuracy": self.eval_accuracy}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRecord:
        ev = d.get("last_event")
        return cls(job_id=d["job_id"], spec=d["spec"], state=JobState(d["state"]), step=d["step"],
                   created_at=d["created_at"], updated_at=d["updated_at"], error=d.get("error", ""),
                   last_event=JobEvent.from_dict(ev) if ev else None, eval_accuracy=d.get("eval_accuracy"))
