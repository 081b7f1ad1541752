"""The per-job rate cap and the bounded, never-blocking sample queue."""

from __future__ import annotations

import threading
import time

import pytest

from onpolicy.verification.queue import RateLimiter, SampleQueue


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rate_limiter_token_bucket_per_job() -> None:
    clock = Clock()
    rl = RateLimiter(rate=2.0, burst=4, clock=clock)
    assert rl.admit("a", 10) == 4  # the full bucket
    assert rl.admit("a", 1) == 0
    assert rl.admit("b", 3) == 3  # another job has its own bucket
    clock.t += 1.0
    assert rl.admit("a", 10) == 2  # refilled at 2/s
    clock.t += 100.0
    assert rl.admit("a", 10) == 4  # never above the burst
    assert RateLimiter(rate=0).admit("a", 1000) == 1000  # 0 = no cap
    assert RateLimiter(rate=3.0).burst == 3.0  # default burst: one second's worth
    with pytest.raises(ValueError):
        RateLimiter(rate=-1)


def test_queue_accepts_what_fits_and_never_blocks() -> None:
    q: SampleQueue[int] = SampleQueue(capacity=5)
    t0 = time.perf_counter()
    assert q.put([1, 2, 3]) == 3
    assert q.put([4, 5, 6]) == 2  # the prefix that fits
    assert q.put([7]) == 0
    assert time.perf_counter() - t0 < 0.1
    assert q.depth == 5
    assert q.take(max_samples=100) == [1, 2, 3, 4, 5]
    assert q.depth == 0 and not q.join(timeout=0.01)  # taken but not done
    q.done(5)
    assert q.join(timeout=0.01)


def test_queue_take_drains_several_batches_within_the_budget() -> None:
    q: SampleQueue[int] = SampleQueue(capacity=100)
    for batch in ([1, 2], [3], [4, 5, 6], [7, 8]):
        q.put(batch)
    assert q.take(max_samples=6) == [1, 2, 3, 4, 5, 6]  # three batches in one take
    assert q.take(max_samples=1) == [7]  # a batch larger than the budget is split
    assert q.take(max_samples=10) == [8]
    q.done(8)
    assert q.take(max_samples=10, timeout=0.05) == []  # empty: times out


def test_queue_take_waits_for_a_put_and_close_wakes_it() -> None:
    q: SampleQueue[int] = SampleQueue(capacity=10)
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(q.take(10, timeout=5)))
    t.start()
    time.sleep(0.05)
    q.put([42])
    t.join(5)
    assert got == [[42]]
    t = threading.Thread(target=lambda: got.append(q.take(10, timeout=5)))
    t.start()
    q.close()
    t.join(5)
    assert got[-1] == [] and q.put([1]) == 0
