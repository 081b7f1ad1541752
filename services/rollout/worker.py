"""``EngineWorker``: the one thread that drives a ``RolloutEngine``.

The engine is single-threaded by design; gRPC handlers run on a thread pool. Every handler talks to
the worker through its inbox: ``submit`` queues a batch of prompts and returns a ``Ticket`` whose
completions arrive as they finish, so concurrent Generate calls share the running batch (results
do not depend on the batch: the invariance rule); ``update_weights`` waits until the requests
already admitted have finished, swaps the weights between two steps, and only then admits what
was queued behind it. A cancelled ticket (its client went away) is aborted between two steps: its
unfinished sequences leave the engine and free their KV pages (``RolloutEngine.abort``), and a
ticket cancelled before it was admitted never enters the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from onpolicy.rollout import Completion, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


class WorkerStopped(RuntimeError):
    """The engine thread has stopped (service shutting down, or the engine failed)."""


class Ticket:
    """The completions of one submitted batch, delivered as they finish."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._queue: queue.Queue[Completion | BaseException] = queue.Queue()
        self.cancelled = threading.Event()
        self.seq_ids: list[int] = []
        """Engine sequence ids of the ticket (engine thread only)."""
        self.prompt_indices: list[int] = []
        """Engine-wide prompt indices of the ticket (engine thread only)."""

    def get(self, timeout: float) -> Completion | None:
        """The next completion, or None after ``timeout`` seconds; raises what failed the batch."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _put(self, item: Completion | BaseException) -> None:
        if not self.cancelled.is_set():
            self._queue.put(item)


@dataclass
class _Submit:
    prompts: list[list[int]]
    params: SamplingParams
    ticket: Ticket


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread once no request is in flight."""

    fn: Callable[[RolloutEngine], Any]
    future: Future[Any]


@dataclass
class _Owner:
    ticket: Ticket
    local: int
    """The prompt's index in its own request."""
    remaining: int
    """Samples of the prompt not finished yet."""


_STOP = object()
_POLL_SECONDS = 0.5


class EngineWorker:
    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Submit | _Call | object] = queue.Queue()
        self._owners: dict[int, _Owner] = {}
        """Engine-wide prompt index (unique per admitted prompt) -> where its completions go."""
        self._prompt_ids = itertools.count()
        self._aborts: queue.Queue[Ticket] = queue.Queue()
        self.aborted_sequences = 0
        """Sequences dropped from the engine because their request was cancelled."""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Ticket:
        """Queue ``params.n`` samples of every prompt (validated by the caller with ``engine.validate``)."""
        self._check_alive()
        ticket = Ticket(len(prompts) * params.n)
        self._inbox.put(_Submit(prompts, params, ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The ticket's client went away: deliver nothing more and abort its unfinished sequences
        (between two engine steps)."""
        if not ticket.cancelled.is_set():
            ticket.cancelled.set()
            self._aborts.put(ticket)

    def call_idle(self, fn: Callable[[RolloutEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps with nothing in flight; returns its
        result or raises its exception (``WorkerStopped`` if the thread ends first)."""
        self._check_alive()
        future: Future[Any] = Future()
        self._inbox.put(_Call(fn, future))
        while True:
            try:
                return future.result(_POLL_SECONDS)
            except TimeoutError:
                self._check_alive()

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if not self.alive:
            raise WorkerStopped("the rollout engine is not running") from self._error

    def _run(self) -> None:
        engine = self.engine
        held: _Call | None = None
        try:
            while True:
                self._abort_cancelled()
                while held is None:  # admit queued work until a call needs the engine idle
                    try:
                        cmd = self._inbox.get(block=not engine.has_unfinished())
                    except queue.Empty:
                        break
                    if cmd is _STOP:
                        return
                    if isinstance(cmd, _Call):
                        held = cmd
                    else:
                        assert isinstance(cmd, _Submit)
                        self._admit(cmd)
                if engine.has_unfinished():
                    self._step()
                elif held is not None:
                    call, held = held, None
                    if call.future.set_running_or_notify_cancel():
                        try:
                            call.future.set_result(call.fn(engine))
                        except Exception as e:
                            call.future.set_exception(e)
        except BaseException as e:
            log.exception("rollout engine thread failed")
            self._error = e
        finally:
            self._fail_all(held)

    def _abort_cancelled(self) -> None:
        while True:
            try:
                ticket = self._aborts.get_nowait()
            except queue.Empty:
                return
            self.aborted_sequences += self.engine.abort(ticket.seq_ids)
            for index in ticket.prompt_indices:
                self._owners.pop(index, None)

    def _admit(self, cmd: _Submit) -> None:
        if cmd.ticket.cancelled.is_set():
            return
        try:
            for p in cmd.prompts:  # all or nothing: no prompt of a bad batch enters the engine
                self.engine.validate(p, cmd.params)
        except ValueError as e:
            cmd.ticket._put(e)
            return
        for local, prompt in enumerate(cmd.prompts):
            index = next(self._prompt_ids)
            self._owners[index] = _Owner(cmd.ticket, local, cmd.params.n)
            cmd.ticket.prompt_indices.append(index)
            cmd.ticket.seq_ids += self.engine.add_request(prompt, cmd.params, prompt_index=index)

    def _step(self) -> None:
        for c in self.engine.step():
            owner = self._owners[c.prompt_index]
            owner.remaining -= 1
            if not owner.remaining:
                del self._owners[c.prompt_index]
            owner.ticket._put(dataclasses.replace(c, prompt_index=owner.local))

    def _fail_all(self, held: _Call | None) -> None:
        """Answer everything still waiting once the thread ends."""
        stopped = WorkerStopped("the rollout engine stopped")
        pending: list[object] = [held] if held is not None else []
        while True:
            try:
                pending.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(stopped)
            elif isinstance(cmd, _Submit):
                cmd.ticket._put(stopped)
        for owner in self._owners.values():
            owner.ticket._put(stopped)
        self._owners.clear()
