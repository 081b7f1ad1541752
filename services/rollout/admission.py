"""``AdmissionGate``: the rollout service's bound on the work it holds.

Every Generate call costs ``n × (prompt length + max_new_tokens)`` token positions — the most KV
cache its sequences can ever occupy. Calls are admitted to the engine while the admitted total
stays within ``max_inflight_tokens``; beyond that a call waits in a FIFO queue of at most
``max_queued_requests`` calls (a waiting call whose client goes away leaves the queue), and a call
that finds the queue full — or that could never fit — is answered RESOURCE_EXHAUSTED at once. So
the sequences held in memory (engine batch, engine waiting list, gate queue) stay bounded however
many clients connect, and the gRPC handler threads are never all parked in the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from onpolicy.services.common.errors import ResourceExhausted

#: How often a queued call checks that its client is still there.
POLL_SECONDS = 0.05


@dataclass
class AdmissionStats:
    admitted: int = 0
    rejected: int = 0
    abandoned: int = 0
    """Calls that left the queue because their client went away (cancel, deadline)."""


class AdmissionGate:
    def __init__(self, max_inflight_tokens: int, max_queued_requests: int) -> None:
        if max_inflight_tokens < 1 or max_queued_requests < 0:
            raise ValueError("max_inflight_tokens must be >= 1 and max_queued_requests >= 0")
        self.max_inflight_tokens, self.max_queued_requests = max_inflight_tokens, max_queued_requests
        self.inflight_tokens = 0
        self.stats = AdmissionStats()
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def acquire(self, tokens: int, active: Callable[[], bool]) -> bool:
        """Admit a call costing ``tokens``: True once admitted (``release`` it later), False if the
        client went away while queued; raises ``ResourceExhausted`` when it cannot be queued."""
        with self._cond:
            if tokens > self.max_inflight_tokens:
                self.stats.rejected += 1
                raise ResourceExhausted(f"the request needs {tokens} token positions; this rollout service admits "
                                        f"at most {self.max_inflight_tokens} at once")
            if not self._queue and self.inflight_tokens + tokens <= self.max_inflight_tokens:
                return self._admit(tokens)
            if len(self._queue) >= self.max_queued_requests:
                self.stats.rejected += 1
                raise ResourceExhausted(f"rollout service busy: {self.inflight_tokens} token positions in flight "
                                        f"and {len(self._queue)} requests queued; retry later")
            me = object()
            self._queue.append(me)
            try:
                while self._queue[0] is not me or self.inflight_tokens + tokens > self.max_inflight_tokens:
                    if not active():
                        self.stats.abandoned += 1
                        return False
                    self._cond.wait(POLL_SECONDS)
                return self._admit(tokens)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()

    def _admit(self, tokens: int) -> bool:
        self.inflight_tokens += tokens
        self.stats.admitted += 1
        return True

    def release(self, tokens: int) -> None:
        with self._cond:
            self.inflight_tokens -= tokens
            self._cond.notify_all()
