"""``Verifier``: recomputes finished rollouts on the training path and keeps logdiff statistics.

Samples are checked against the verifier's own copy of the weights, which follows the trainer's
weight versions. A sample produced under a different weight version than the one loaded is not
compared (it is dropped, counted with reason ``stale_weights``), since its logdiff would measure the
weight change, not the kernels — except that a sample from a foreign engine (``source`` other than
``onpolicy``, e.g. ``vllm``) with ``weight_version`` 0/unset is taken to be at the current version:
an external engine serving the weights the trainer published need not know our version numbers.

A sample carries the temperature and truncation (top-k / top-p / min-p) its logprobs were computed
at; the training path scores the same renormalised distribution. One ``verify`` call is one
recompute: all its samples go through ``sequence_logprobs`` together, packed into forwards of up to
``pack_tokens`` tokens (the asynchronous worker drains several queued batches into one call).
Statistics are kept per job and overall, and fed to a ``VerificationSink`` (``sink``); samples with a nonzero
logdiff are offered to the ``MismatchStore``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from onpolicy.kernels.truncation import Truncation
from onpolicy.models.loading import LoadedModel, copy_weights_
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .logdiff import LogdiffStats
from .mismatch_store import MismatchRecord, MismatchStore
from .sink import VerificationSink

OWN_SOURCE = "onpolicy"


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
    source: str = OWN_SOURCE
    received_at: float = 0.0
    """Unix time the verifier received the sample (the lag metric's reference point)."""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    """The truncation the sample's logprobs were computed at (off: 0, 1, 0): recomputed with it."""

    @property
    def scored(self) -> ScoredSequence:
        """The sequence the training path scores: at the sample's temperature and truncation."""
        return ScoredSequence(self.prompt_ids, self.token_ids, self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p)


@dataclass
class BatchResult:
    stats: LogdiffStats
    dropped: int
    stored: list[Path] = field(default_factory=list)
    """Mismatch files written for this batch."""


class Verifier:
    def __init__(self, lm: LoadedModel, pack_tokens: int = 4096, *, metrics: VerificationSink | None = None,
                 mismatch_store: MismatchStore | None = None) -> None:
        self.lm = lm
        self.pack_tokens = pack_tokens
        self.metrics = metrics
        self.mismatch_store = mismatch_store
        self.weight_version = 0
        self.weights_path = ""
        self.weights_file_sha256 = ""
        self._compute = threading.Lock()
        """Held while the model is used or its weights replaced."""
        self._stats = threading.Lock()
        """Held briefly to update or read statistics (never during a forward)."""
        self.per_job: dict[str, LogdiffStats] = {}
        self.total = LogdiffStats()
        self.dropped = 0
        self.dropped_per_job: dict[str, int] = {}

    def check_sample(self, s: VerifySample) -> None:
        """Raise ``ValueError`` naming the problem if ``s`` cannot be scored by this model."""
        vocab = self.lm.config.vocab_size
        if not s.prompt_ids or not s.token_ids:
            raise ValueError("prompt_ids and token_ids must not be empty")
        if len(s.logprobs) != len(s.token_ids):
            raise ValueError(f"{len(s.logprobs)} logprobs for {len(s.token_ids)} tokens")
        if any(not 0 <= t < vocab for t in (*s.prompt_ids, *s.token_ids)):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if not all(math.isfinite(x) for x in s.logprobs):
            raise ValueError("logprobs must be finite")
        if not (s.temperature > 0 and math.isfinite(s.temperature)):
            raise ValueError("temperature must be > 0")
        Truncation(top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)  # raises ValueError naming the field

    def is_current(self, s: VerifySample) -> bool:
        return s.weight_version == self.weight_version or (s.source != OWN_SOURCE and s.weight_version == 0)

    def record_dropped(self, job_id: str, reason: str, n: int) -> None:
        """Count ``n`` samples of ``job_id`` that were not verified (``queue_full``, ``rate_limit``, …)."""
        if n <= 0:
            return
        with self._stats:
            self.dropped += n
            self.dropped_per_job[job_id] = self.dropped_per_job.get(job_id, 0) + n
        if self.metrics is not None:
            self.metrics.dropped(job_id, reason, n)

    def verify(self, samples: Sequence[VerifySample]) -> BatchResult:
        """Recompute ``samples`` in one batched pass (packed forwards of ``pack_tokens``) and account them."""
        with self._compute:
            version, path, file_sha = self.weight_version, self.weights_path, self.weights_file_sha256
            current = [s for s in samples if self.is_current(s)]
            stale = [s for s in samples if not self.is_current(s)]
            trainer: list[torch.Tensor] = []
            if current:
                seqs = [s.scored for s in current]
                with torch.no_grad():
                    trainer = sequence_logprobs(self.lm.model, seqs, pack_tokens=self.pack_tokens)
        batch = LogdiffStats()
        jobs: dict[str, tuple[LogdiffStats, list[torch.Tensor], float]] = {}
        stored: list[Path] = []
        for i, (s, t) in enumerate(zip(current, trainer, strict=True)):
            rollout = torch.tensor(s.logprobs, dtype=torch.float32)
            t = t.detach().float().reshape(-1)
            one = LogdiffStats()
            diff = one.add(rollout, t)
            batch.merge(one)
            stats, diffs, newest = jobs.setdefault(s.job_id, (LogdiffStats(), [], 0.0))
            stats.merge(one)
            diffs.append(diff)
            jobs[s.job_id] = (stats, diffs, max(newest, s.received_at))
            store = self.mismatch_store
            if one.mismatched_tokens and store is not None and store.wants(s.job_id, one.max_abs_logdiff):
                rec = self._record(s, rollout, t, one, version, path, file_sha, len(current), i)
                written = store.offer(rec)
                if written is not None:
                    stored.append(written)
        with self._stats:
            for job, (stats, _, _) in jobs.items():
                self.per_job.setdefault(job, LogdiffStats()).merge(stats)
            self.total.merge(batch)
        for s in stale:
            self.record_dropped(s.job_id, "stale_weights", 1)
        if self.metrics is not None:
            if current:
                self.metrics.recomputed()
            for job, (stats, diffs, newest) in jobs.items():
                self.metrics.observe(job, torch.cat(diffs), stats.mismatched_tokens, stats.sequences_checked,
                                     stats.kl_k3_sum, newest)
        return BatchResult(batch, len(stale), stored)

    def _record(self, s: VerifySample, rollout: torch.Tensor, trainer: torch.Tensor, one: LogdiffStats,
                version: int, path: str, file_sha: str, batch_size: int, index: int) -> MismatchRecord:
        cfg = self.lm.model.ops.config
        first = int(torch.nonzero(rollout != trainer)[0, 0])
        return MismatchRecord(
            model=self.lm.name, kernel_fingerprint=s.kernel_fingerprint, trainer_kernel_fingerprint=cfg.fingerprint,
            trainer_kernel_config=asdict(cfg), weight_version=version, weights_path=path, weights_sha256=file_sha,
            prompt_ids=list(s.prompt_ids), token_ids=list(s.token_ids), logprobs=rollout.tolist(),
            trainer_logprobs=trainer.tolist(), temperature=float(s.temperature), top_k=s.top_k, top_p=s.top_p,
            min_p=s.min_p, source=s.source, job_id=s.job_id,
            step=s.step, max_abs_logdiff=one.max_abs_logdiff, first_mismatch_index=first,
            mismatched_tokens=one.mismatched_tokens,
            batch={"samples": batch_size, "index": index, "pack_tokens": self.pack_tokens})

    def report(self, job_id: str = "") -> LogdiffStats:
        with self._stats:
            src = self.per_job.get(job_id, LogdiffStats()) if job_id else self.total
            out = LogdiffStats()
            out.merge(src)
            return out

    def dropped_for(self, job_id: str = "") -> int:
        with self._stats:
            return self.dropped_per_job.get(job_id, 0) if job_id else self.dropped

    def weights_snapshot(self) -> tuple[dict[str, torch.Tensor], int]:
        """A copy of the current weights and their version (for a diagnosis replay)."""
        with self._compute:
            return {k: v.detach().clone() for k, v in self.lm.model.state_dict().items()}, self.weight_version

    def update_weights(self, state: dict[str, torch.Tensor], version: int, path: str = "", sha256: str = "") -> None:
        with self._compute:
            copy_weights_(self.lm.model, state)
            self.weight_version = version
            self.weights_path, self.weights_file_sha256 = path, sha256
        if self.metrics is not None:
            self.metrics.weight_version = version
