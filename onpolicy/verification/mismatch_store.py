"""``MismatchStore``: the N worst mismatching samples of each job, kept as replayable JSON files.

Layout: ``<mismatch_dir>/<job>/step<step:06d>-<digest>.json`` — ``<job>`` is the job id when it
is a safe file name (``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``), else ``job-<sha256 prefix>``, and
``_nojob`` for an empty id. Only samples with ``max_abs_logdiff > 0`` are offered; per job the
``keep`` samples with the largest ``max_abs_logdiff`` are kept (a newcomer must be strictly worse
than the best-behaved kept one to replace it, whose file is then deleted). Every file is written
atomically (``onpolicy.weights.atomic_write_bytes``: temporary file, fsync, rename), so a reader
never sees a partial file. A restarted verifier rescans a job's directory before adding to it.

JSON schema (one object per file; ``onpolicy diagnose SAMPLE.json`` replays it) —

====================================  ==========================================================
key                                   value
====================================  ==========================================================
``kind``                              ``"onpolicy.mismatch"``
``schema_version``                    ``1``
``model``                             model reference the verifier loaded (registry name such as
                                      ``tiny-qwen3``/``smollm2``, or a checkpoint path)
``kernel_fingerprint``                fingerprint of the engine that produced ``logprobs`` as the
                                      submitter reported it ("" when unknown, e.g. a vLLM sample)
``trainer_kernel_fingerprint``        fingerprint of the verifier's training path
``trainer_kernel_config``             that ``KernelConfig`` as a dict (``backend``, ``kv_tile`` …)
``weight_version``                    weight version both logprobs were computed under (0 = base)
``weights_path``                      safetensors file of that version ("" for the base weights
                                      of ``model``); ``weights_sha256``: its checksum ("" if base)
``prompt_ids``                        list of int
``token_ids``                         list of int, the sampled continuation
``logprobs``                          list of float, the submitted (rollout) logprob of each token
``trainer_logprobs``                  list of float, the training-path logprob of each token
``temperature``                       temperature the logprobs were computed at (float > 0)
``top_k`` / ``top_p`` / ``min_p``     truncation the logprobs were computed at (optional; off:
                                      0 / 1 / 0; ``onpolicy.kernels.truncation``)
``source``                            engine that produced ``logprobs``: ``onpolicy``, ``vllm`` …
``job_id`` / ``step``                 job and step the sample was submitted with
``max_abs_logdiff``                   max over tokens of ``|logprobs[i] - trainer_logprobs[i]|``
``first_mismatch_index``              first ``i`` whose two logprobs are not bitwise equal
``mismatched_tokens``                 how many tokens differ
``batch``                             recompute context: ``{"samples": n, "index": i, "pack_tokens": P}``
``created_at``                        Unix time the file was written
====================================  ==========================================================

Logprobs are fp32 values written as their exact decimal (double) value, so ``float32(x)`` gives
back the same bits; ``len(logprobs) == len(trainer_logprobs) == len(token_ids)``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import re
import struct
import threading
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from onpolicy.weights import atomic_write_bytes

log = logging.getLogger(__name__)

KIND = "onpolicy.mismatch"
SCHEMA_VERSION = 1
_SAFE_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def job_dirname(job_id: str) -> str:
    """A directory name for ``job_id`` that cannot escape the store (no ``/``, no ``..``)."""
    if not job_id:
        return "_nojob"
    if _SAFE_JOB.fullmatch(job_id) and ".." not in job_id:
        return job_id
    return "job-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class MismatchRecord:
    model: str
    kernel_fingerprint: str
    trainer_kernel_fingerprint: str
    weight_version: int
    weights_path: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    trainer_logprobs: list[float]
    temperature: float
    source: str
    job_id: str
    step: int
    max_abs_logdiff: float
    first_mismatch_index: int
    mismatched_tokens: int
    weights_sha256: str = ""
    trainer_kernel_config: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)
    created_at: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"kind": KIND, "schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MismatchRecord:
        """Parse a stored file's object; ``ValueError`` naming the first problem."""
        if data.get("kind") != KIND or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"not an {KIND} v{SCHEMA_VERSION} file")
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in data
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"missing keys: {', '.join(missing)}")
        rec = cls(**{k: v for k, v in data.items() if k in names})
        if not (len(rec.logprobs) == len(rec.trainer_logprobs) == len(rec.token_ids)):
            raise ValueError("token_ids, logprobs and trainer_logprobs must have the same length")
        return rec

    def digest(self) -> str:
        h = hashlib.sha256(f"{self.job_id}\0{self.step}\0{self.weight_version}\0".encode())
        h.update(struct.pack(f"<{len(self.prompt_ids)}q", *self.prompt_ids))
        h.update(struct.pack(f"<{len(self.token_ids)}q", *self.token_ids))
        h.update(struct.pack(f"<{len(self.logprobs)}f", *self.logprobs))
        return h.hexdigest()[:16]


def load_mismatch(path: str | Path) -> MismatchRecord:
    return MismatchRecord.from_json(json.loads(Path(path).read_text()))


class MismatchStore:
    """Keeps the ``keep`` worst mismatching samples per job under ``directory`` (thread-safe)."""

    def __init__(self, directory: str | Path, keep: int = 16, max_jobs: int = 1024) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = Path(directory)
        self.keep, self.max_jobs = keep, max_jobs
        self._heaps: dict[str, list[tuple[float, str]]] = {}  # job dir -> min-heap of (max_abs, file name)
        self._lock = threading.Lock()

    def job_dir(self, job_id: str) -> Path:
        return self.directory / job_dirname(job_id)

    def _heap(self, job_id: str) -> list[tuple[float, str]] | None:
        name = job_dirname(job_id)
        heap = self._heaps.get(name)
        if heap is None:
            if len(self._heaps) >= self.max_jobs:
                return None
            heap = []
            for p in sorted(self.job_dir(job_id).glob("*.json")):
                try:
                    heap.append((float(json.loads(p.read_text())["max_abs_logdiff"]), p.name))
                except (OSError, ValueError, KeyError, TypeError):
                    log.warning("ignoring unreadable mismatch file %s", p)
            heapq.heapify(heap)
            self._heaps[name] = heap
            self._trim(job_id, heap)
        return heap

    def _trim(self, job_id: str, heap: list[tuple[float, str]]) -> None:
        while len(heap) > self.keep:
            _, old = heapq.heappop(heap)
            (self.job_dir(job_id) / old).unlink(missing_ok=True)

    def wants(self, job_id: str, max_abs_logdiff: float) -> bool:
        """Whether a sample this bad would be kept (cheap: decide before building the record)."""
        if not max_abs_logdiff > 0:
            return False
        with self._lock:
            heap = self._heap(job_id)
            return heap is not None and (len(heap) < self.keep or max_abs_logdiff > heap[0][0])

    def offer(self, rec: MismatchRecord) -> Path | None:
        """Store ``rec`` if it is among the job's ``keep`` worst; returns its file or None."""
        with self._lock:
            heap = self._heap(rec.job_id)
            if heap is None or not rec.max_abs_logdiff > 0:
                return None
            if len(heap) >= self.keep and not rec.max_abs_logdiff > heap[0][0]:
                return None
            name = f"step{rec.step:06d}-{rec.digest()}.json"
            path = self.job_dir(rec.job_id) / name
            if any(n == name for _, n in heap):
                return path
            if not rec.created_at:
                rec = MismatchRecord(**{**asdict(rec), "created_at": time.time()})
            atomic_write_bytes(path, json.dumps(rec.to_json(), indent=1).encode())
            heapq.heappush(heap, (rec.max_abs_logdiff, name))
            self._trim(rec.job_id, heap)
            return path

    def paths(self, job_id: str) -> list[Path]:
        """The job's stored files, worst first."""
        with self._lock:
            heap = self._heap(job_id) or []
            return [self.job_dir(job_id) / n for _, n in sorted(heap, reverse=True)]
