"""``Scheduler``: decides, each step, how many tokens every request catches up by.

There are no separate prefill and decode phases: a running request with ``k`` uncomputed tokens is
given ``min(k, budget)`` of the step's ``max_batched_tokens`` (chunked prefill); a decoding request
needs one. Waiting requests are admitted while ``max_num_seqs`` and the KV pages allow; when a
running request cannot get a page, the most recently admitted one is preempted (its pages freed,
recomputed later — bitwise harmless, since every kernel is invariant to the schedule). With
speculative decoding on, the tokens a ``drafter`` proposes for each decoding request are added last,
from the budget and the pages left once every request has its rows and the waiting ones are
admitted: a draft never preempts or delays anyone (``onpolicy.rollout.speculative``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int
    """First token position computed this step (== seq.num_computed)."""
    num_tokens: int
    """Rows computed this step, the drafted tokens included."""
    draft: tuple[int, ...] = ()
    """Drafted tokens computed after the sequence's last token (speculative decoding)."""

    @property
    def samples(self) -> bool:
        """True if this chunk reaches the end of the sequence, so its last row (and every drafted
        row) is sampled."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq.tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


Drafter = Callable[[Sequence], list[int]]
"""Proposes the tokens to verify after a decoding sequence's last token."""


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int,
                 drafter: Drafter | None = None) -> None:
        if max_num_seqs < 1 or max_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_batched_tokens must be >= 1")
        self.blocks = blocks
        self.drafter = drafter
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_to_compute, budget)
            while not self.blocks.can_grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self.blocks.grow(seq, seq.num_computed + n)
            out.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            prefix_tokens = len(self.blocks.cached_prefix(seq)) * self.blocks.page_size
            n = min(len(seq.tokens) - prefix_tokens, budget)
            if not self.blocks.admit(seq, n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        if self.drafter is not None:
            self._add_drafts(out, budget)
        return SchedulerOutput(out, preempted)

    def _add_drafts(self, out: list[ScheduledSeq], budget: int) -> None:
        """Extend each decoding request's one row in ``out`` by its drafter's tokens, cut to the
        ``budget`` left, dropped when they need a page that is not free."""
        assert self.drafter is not None
        for j, s in enumerate(out):
            if budget < 1:
                return
            if s.num_tokens != 1 or s.seq.num_to_compute != 1:
                continue
            draft = tuple(self.drafter(s.seq)[:budget])
            if not draft or not self.blocks.can_grow(s.seq, s.start + 1 + len(draft)):
                continue
            self.blocks.grow(s.seq, s.start + 1 + len(draft))
            out[j] = ScheduledSeq(s.seq, s.start, 1 + len(draft), draft)
            budget -= len(draft)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.blocks.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished ``seq`` (waiting or running), freeing its KV pages."""
        if seq.status is Status.RUNNING:
            self.finish(seq, "abort")
        else:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
