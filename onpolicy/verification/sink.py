"""``VerificationSink``: what a ``Verifier`` reports its checks to (the runtime's is
``onpolicy.services.verifier.metrics.VerifierMetrics``, Prometheus families at scrape time)."""

from __future__ import annotations

from typing import Protocol

import torch


class VerificationSink(Protocol):
    """Receives a verifier's accounting; every call must be cheap and thread-safe."""

    weight_version: int
    """Weight version the verifier holds (0 = base weights)."""

    def observe(self, job: str, diffs: torch.Tensor, mismatched: int, sequences: int, kl_sum: float,
                newest_received: float) -> None:
        """One verified batch of ``job``: ``diffs`` = every token's |logdiff| (fp32);
        ``newest_received`` = receive time of its newest sample (0: unknown)."""

    def dropped(self, job: str, reason: str, n: int) -> None:
        """``n`` samples of ``job`` not verified, for ``reason``."""

    def recomputed(self) -> None:
        """One training-path recompute ran."""
