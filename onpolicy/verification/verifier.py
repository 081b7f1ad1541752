"""``Verifier``: recomputes finished rollouts on the training path and keeps logdiff statistics.

Samples are checked against the verifier's own copy of the weights, which follows the trainer's
weight versions; a sample produced under a different weight version than the one loaded is not
compared (it is counted as dropped), since its logdiff would measure the weight change, not the
kernels. Statistics are kept per job and overall.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onpolicy.models.checkpoint import LoadedModel, copy_weights_
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .logdiff import LogdiffStats


@dataclass(frozen=True)
class VerifySample:
    job_id: str
    step: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    temperature: float
    weight_version: int
    kernel_fingerprint: str = ""
    source: str = "onpolicy"


@dataclass
class BatchResult:
    stats: LogdiffStats
    dropped: int


class Verifier:
    def __init__(self, lm: LoadedModel, pack_tokens: int = 4096) -> None:
        self.lm = lm
        self.pack_tokens = pack_tokens
        self.weight_version = 0
        self._lock = threading.Lock()
        self.per_job: dict[str, LogdiffStats] = {}
        self.total = LogdiffStats()
        self.dropped = 0

    def check_sample(self, s: VerifySample) -> None:
        """Raise ``ValueError`` naming the problem if ``s`` cannot be scored by this model."""
        vocab = self.lm.config.vocab_size
        if not s.prompt_ids or not s.token_ids:
            raise ValueError("prompt_ids and token_ids must not be empty")
        if len(s.logprobs) != len(s.token_ids):
            raise ValueError(f"{len(s.logprobs)} logprobs for {len(s.token_ids)} tokens")
        if any(not 0 <= t < vocab for t in (*s.prompt_ids, *s.token_ids)):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if not (s.temperature > 0 and s.temperature == s.temperature):
            raise ValueError("temperature must be > 0")

    def verify(self, samples: Sequence[VerifySample]) -> BatchResult:
        """Recompute ``samples`` (batched, one packed forward per ``pack_tokens``) and account them."""
        with self._lock:
            current = [s for s in samples if s.weight_version == self.weight_version]
            dropped = len(samples) - len(current)
            batch = LogdiffStats()
            if current:
                seqs = [ScoredSequence(s.prompt_ids, s.token_ids, s.temperature) for s in current]
                with torch.no_grad():
                    trainer = sequence_logprobs(self.lm.model, seqs, pack_tokens=self.pack_tokens)
                for s, t in zip(current, trainer, strict=True):
                    one = LogdiffStats()
                    one.add(torch.tensor(s.logprobs, dtype=torch.float32), t)
                    batch.merge(one)
                    self.per_job.setdefault(s.job_id, LogdiffStats()).merge(one)
            self.total.merge(batch)
            self.dropped += dropped
            return BatchResult(batch, dropped)

    def report(self, job_id: str = "") -> LogdiffStats:
        with self._lock:
            src = self.per_job.get(job_id, LogdiffStats()) if job_id else self.total
            out = LogdiffStats()
            out.merge(src)
            return out

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            copy_weights_(self.lm.model, state)
            self.weight_version = version
