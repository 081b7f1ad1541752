"""``VerifierConfig``: every knob of the verifier service in one flat, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onpolicy.home import onpolicy_home


def default_mismatch_dir() -> Path:
    """``$ONPOLICY_HOME/mismatches`` (``~/.cache/onpolicy/mismatches`` when unset)."""
    return onpolicy_home() / "mismatches"


@dataclass(frozen=True, kw_only=True)
class VerifierConfig:
    job: str = ""
    """Job this verifier was started for (label of its service-level metrics; "" when shared)."""
    pack_tokens: int = 4096
    """Most tokens in one packed training-path forward."""
    queue_samples: int = 1024
    """Capacity of the asynchronous queue, in samples; what does not fit is dropped (counted)."""
    max_batch_samples: int = 256
    """Most queued samples drained into one recompute (one ``verify`` call, packed forwards)."""
    max_samples_per_second: float = 0.0
    """Per-job cap on samples accepted per second (token bucket), wait or not; 0 = no cap."""
    burst_samples: int = 0
    """Bucket size of the rate cap (default: one second's worth, at least 1)."""
    logdiff_max_window_s: float = 60.0
    """``onpolicy_logdiff_max`` / ``onpolicy_kl_k3`` cover the batches verified in this many
    seconds, and always at least the most recent batch."""
    mismatch_dir: str = ""
    """Directory of the mismatch store (default ``$ONPOLICY_HOME/mismatches``)."""
    mismatch_keep: int = 16
    """The N worst mismatching samples kept per job (0 switches the store off)."""
    max_metric_jobs: int = 64
    """Distinct ``job`` label values before further jobs are reported as ``job="_other"``."""
    rollout_kernel_fingerprint: str = ""
    """Recorded (mismatch store) for ``source="onpolicy"`` samples that carry no fingerprint: the
    kernel config of the job's own rollout engine, which the launcher knows."""

    def __post_init__(self) -> None:
        for name in ("pack_tokens", "queue_samples", "max_batch_samples", "max_metric_jobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_samples_per_second", "burst_samples", "mismatch_keep"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.logdiff_max_window_s > 0:
            raise ValueError("logdiff_max_window_s must be > 0")

    @property
    def mismatch_path(self) -> Path:
        return Path(self.mismatch_dir) if self.mismatch_dir else default_mismatch_dir()
