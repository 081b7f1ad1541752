"""``VerificationWorker``: the one thread that drains the asynchronous queue.

Each round it waits for queued samples, then takes every queued batch that fits in
``max_batch_samples`` and verifies them in one ``Verifier.verify`` call (one batched recompute,
packed forwards), so a burst of small submissions costs a few large forwards, not many small ones.
"""

from __future__ import annotations

import logging
import threading

from onpolicy.verification.queue import SampleQueue
from onpolicy.verification.verifier import Verifier, VerifySample

log = logging.getLogger(__name__)
_POLL_SECONDS = 0.5


class VerificationWorker:
    def __init__(self, verifier: Verifier, queue: SampleQueue[VerifySample], max_batch_samples: int) -> None:
        self.verifier, self.queue, self.max_batch_samples = verifier, queue, max_batch_samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="verifier-worker")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self.queue.take(self.max_batch_samples, timeout=_POLL_SECONDS)
            if not batch:
                continue
            try:
                self.verifier.verify(batch)
            except Exception:
                log.exception("verification of %d queued samples failed", len(batch))
                for s in batch:
                    self.verifier.record_dropped(s.job_id, "error", 1)
            finally:
                self.queue.done(len(batch))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been verified; True if it was in time."""
        return self.queue.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.queue.close()
        self._thread.join(timeout)
