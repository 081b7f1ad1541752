"""How much the verifier checks: a per-job rate cap and a bounded queue that never blocks its caller.

* ``RateLimiter`` — a token bucket per key (the job id): ``admit(key, n)`` says how many of ``n``
  samples may be verified now; the rest are dropped by the caller and counted.
* ``SampleQueue`` — the asynchronous path's FIFO, bounded in *samples* (not batches). ``put``
  never waits: it accepts the prefix of a batch that fits and reports how many were accepted, so
  a slow verifier can never slow the rollout that submits to it. ``take`` hands the worker several
  queued batches at once (up to a sample budget) so they are recomputed in one packed forward.

The fraction of each step's completions sent at all is the job's business (the GRPO loop samples
``verifier.sample_fraction`` of them); these two bound what a verifier accepts whoever sends.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class RateLimiter:
    """Token buckets of ``burst`` samples refilled at ``rate`` samples per second, one per key;
    ``rate`` 0 admits everything."""

    _MAX_KEYS = 4096

    def __init__(self, rate: float, burst: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0 or burst < 0:
            raise ValueError("rate and burst must be >= 0")
        self.rate = float(rate)
        self.burst = float(burst) if burst else max(1.0, self.rate)
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def admit(self, key: str, n: int) -> int:
        """How many of ``n`` samples of ``key`` may pass now (those are taken from its bucket)."""
        if self.rate <= 0 or n <= 0:
            return max(n, 0)
        with self._lock:
            now = self.clock()
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            k = min(n, int(tokens))
            self._buckets[key] = (tokens - k, now)
            if len(self._buckets) > self._MAX_KEYS:  # forget idle keys (their buckets are full again)
                full = [k_ for k_, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst]
                for k_ in full:
                    del self._buckets[k_]
            return k


class SampleQueue(Generic[T]):
    """A FIFO of sample batches holding at most ``capacity`` samples; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._batches: deque[list[T]] = deque()
        self._size = 0
        self._in_flight = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def depth(self) -> int:
        """Samples waiting (not counting those the worker is recomputing)."""
        return self._size

    def put(self, batch: Sequence[T]) -> int:
        """Queue the prefix of ``batch`` that fits; returns its length (never waits)."""
        with self._cond:
            if self._closed:
                return 0
            k = min(len(batch), self.capacity - self._size)
            if k > 0:
                self._batches.append(list(batch[:k]))
                self._size += k
                self._cond.notify_all()
            return k

    def take(self, max_samples: int, timeout: float | None = None) -> list[T]:
        """Wait for queued samples (up to ``timeout``), then take whole batches in order while they
        fit in ``max_samples`` — at least one sample; a batch larger than the budget is split.
        Returns [] on timeout or once closed. Call ``done(len(result))`` when they are accounted."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._size or self._closed, timeout) or not self._size:
                return []
            out: list[T] = []
            while self._batches and len(out) < max_samples:
                head = self._batches[0]
                room = max_samples - len(out)
                if len(head) <= room:
                    out += self._batches.popleft()
                elif out:
                    break  # keep batches whole unless a single one exceeds the budget
                else:
                    out += head[:room]
                    del head[:room]
            self._size -= len(out)
            self._in_flight += len(out)
            return out

    def done(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every queued sample has been taken and marked done; True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._size and not self._in_flight, timeout)

    def close(self) -> None:
        """Refuse further ``put``s and wake waiting ``take``s (queued samples are still handed out)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
