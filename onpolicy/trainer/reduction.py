"""Canonical gradient reduction: the fixed tree in which the gradients of a minibatch's units are summed,
so that any data-parallel degree reproduces one worker's bits.

A minibatch is cut into **units** — its greedy in-order packs of at most ``pack_tokens`` rows
(``onpolicy.trainer.forward.pack`` over the *global* minibatch), which do not depend on how many
workers there are. Each unit's gradient is computed on its own (one forward, one backward) and kept
in fp32. The minibatch gradient is the **tree fold** of the unit gradients: the sum over units
``[lo, hi)`` is ``fold(lo, mid) + fold(mid, hi)`` with ``mid = (lo + hi) // 2``, a single unit is its
own gradient, an empty range is nothing (``x + nothing = x``, so splitting a unit off an empty range
changes no bit).

With ``D`` (a power of two) data-parallel workers, worker ``r`` owns the node of depth ``log2(D)``
reached by following the bits of ``r`` from the most significant (0 = left half): ``unit_range``. It
folds its own subtree locally, the ``D`` subtree sums are all-gathered (``GradientExchange``), and
every worker folds them pairwise level by level (``fold_levels``) — the top of the same tree. So every
``D`` gives the bits of ``D = 1``, and every worker applies the identical update; only ``D`` partial
sums cross the wire, never one per unit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

Grads = list[Tensor | None]
"""One fp32 tensor per parameter, ``None`` for a parameter no token reached (it gets no update)."""


def check_degree(degree: int) -> None:
    if degree < 1 or degree & (degree - 1):
        raise ValueError(f"the data-parallel degree must be a power of two >= 1, got {degree}")


def unit_range(units: int, degree: int, rank: int) -> range:
    """The units ``[lo, hi)`` that ``rank`` of ``degree`` workers folds: a node of the canonical tree
    (possibly empty when there are fewer units than workers)."""
    check_degree(degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is outside [0, {degree})")
    lo, hi = 0, units
    bit = degree >> 1
    while bit:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if rank & bit else (lo, mid)
        bit >>= 1
    return range(lo, hi)


def add(a: Grads | None, b: Grads | None) -> Grads | None:
    """``a + b`` per parameter in fp32 (``None`` is nothing: an empty range or an unreached parameter)."""
    if a is None or b is None:
        return b if a is None else a
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b, strict=True)]


def fold_tree(lo: int, hi: int, unit_grads: Callable[[int], Grads]) -> Grads | None:
    """The canonical fold of units ``[lo, hi)``; ``unit_grads(i)`` computes unit ``i`` (called in order,
    so at most ``log2(hi - lo) + 1`` partial sums are alive at once)."""
    if hi - lo <= 0:
        return None
    if hi - lo == 1:
        return unit_grads(lo)
    mid = (lo + hi) // 2
    left = fold_tree(lo, mid, unit_grads)
    return add(left, fold_tree(mid, hi, unit_grads))


def fold_levels(partials: Sequence[Grads | None]) -> Grads | None:
    """The top of the tree: the subtree sums of ranks ``0..D-1`` folded pairwise, level by level."""
    check_degree(len(partials))
    level = list(partials)
    while len(level) > 1:
        level = [add(level[k], level[k + 1]) for k in range(0, len(level), 2)]
    return level[0]


class GradientExchange(Protocol):
    """The collectives a data-parallel train step needs (every rank calls them in the same order)."""

    rank: int
    size: int

    def all_gather_grads(self, grads: Grads | None, like: Sequence[Tensor]) -> list[Grads | None]:
        """Every rank's ``grads`` (``like``: the parameters, for shapes), in rank order."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        ...


class Solo:
    """The exchange of a single worker: nothing crosses a wire."""

    rank = 0
    size = 1

    def all_gather_grads(self, grads: Grads | None, like: Sequence[Tensor]) -> list[Grads | None]:
        return [grads]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]
