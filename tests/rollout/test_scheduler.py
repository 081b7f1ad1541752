"""The scheduler alone (no model): a decoding request's draft takes only what is left once every
running request has its row and the waiting ones are admitted, so speculation never preempts or
delays another request."""

from __future__ import annotations

from onpolicy.rollout.block_manager import BlockManager
from onpolicy.rollout.scheduler import Scheduler
from onpolicy.rollout.sequence import SamplingParams, Sequence, Status

PARAMS = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def _decoding(seq_id: int, prompt: list[int], sched: Scheduler) -> Sequence:
    """``prompt`` prefilled (its K/V cached but the last token's) and running."""
    seq = Sequence(seq_id, seq_id, 0, tuple(prompt), PARAMS, frozenset())
    sched.add(seq)
    return seq


def _schedule_prefills(sched: Scheduler) -> None:
    """Admit and 'compute' every waiting prompt but its last token, as a finished prefill leaves it."""
    for s in sched.schedule().scheduled:
        s.seq.num_computed = s.start + s.num_tokens
    for seq in sched.running:
        seq.tokens.append(7)  # the token sampled at the prefill's last row


def _scheduler(drafter) -> tuple[Scheduler, Sequence, Sequence]:
    # 3 pages of 4 tokens: A has 3 of 4 tokens cached (one page), B 4 of 5 (one full page): one page
    # is free, and only B's next row needs it
    sched = Scheduler(BlockManager(num_pages=3, page_size=4, prefix_cache=False), max_num_seqs=8,
                      max_batched_tokens=64, drafter=drafter)
    a, b = _decoding(0, [1, 2, 3], sched), _decoding(1, [4, 5, 6, 8], sched)
    _schedule_prefills(sched)
    return sched, a, b


def test_drafts_never_preempt_a_running_request() -> None:
    plain, _, _ = _scheduler(drafter=None)
    out = plain.schedule()
    assert [(s.seq.seq_id, s.num_tokens, s.draft) for s in out.scheduled] == [(0, 1, ()), (1, 1, ())]
    assert out.preempted == 0

    spec, _, b = _scheduler(drafter=lambda seq: [1, 2, 3])
    out = spec.schedule()
    assert out.preempted == 0 and b.status is Status.RUNNING
    rows = {s.seq.seq_id: (s.num_tokens, s.draft) for s in out.scheduled}
    # B's decode row took the last free page; A's draft would need another page, so A has none, and
    # B's draft fills the rest of B's new page
    assert rows == {0: (1, ()), 1: (4, (1, 2, 3))}


def test_drafts_use_what_is_left() -> None:
    sched = Scheduler(BlockManager(num_pages=8, page_size=4, prefix_cache=False), max_num_seqs=8,
                      max_batched_tokens=64, drafter=lambda seq: [1, 2, 3])
    a = _decoding(0, [1, 2, 3], sched)
    _schedule_prefills(sched)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_tokens, s.draft) for s in out.scheduled] == [(0, 4, (1, 2, 3))]
    assert a.status is Status.RUNNING and out.preempted == 0
