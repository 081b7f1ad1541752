"""The local launcher fails fast and names the rank when a worker raises or dies while its peer is
blocked in a collective (no hang). Successful multi-process runs are in test_tp_ep_invariance."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from onpolicy.parallel.launch import WorkerError, run_workers


def rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for a peer that never comes


def rank1_dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize(("fn", "message"), [(rank1_raises, "rank 1 of 2 failed: ValueError: boom from rank 1"),
                                             (rank1_dies, "rank 1 of 2 exited with code 3")])
def test_a_failing_rank_fails_the_run_without_hanging(fn: object, message: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        run_workers(fn, 2, timeout_s=120)  # type: ignore[arg-type]
    assert message in str(err.value)
    assert time.monotonic() - t0 < 100  # well before the collective timeout
