"""The canonical gradient tree: rank ranges tile the units in order at every degree, and folding each
rank's subtree then the ranks' sums level by level gives the bits of one worker's fold (real fp32
tensors, torch.equal)."""

from __future__ import annotations

import pytest
import torch

from onpolicy.trainer.reduction import Grads, add, fold_levels, fold_tree, unit_range

DEGREES = (1, 2, 4, 8)


def _unit(i: int) -> Grads:
    """Unit ``i``'s gradients: values of very different magnitudes (so the order of additions shows in
    the bits), and a parameter only some units reach (``None`` elsewhere)."""
    g = torch.Generator().manual_seed(i)
    big = torch.randn(7, 5, generator=g) * 10.0 ** torch.randint(-6, 7, (7, 5), generator=g)
    return [big, torch.randn(3, generator=g) * 1e-3, torch.ones(2) * i if i % 3 == 0 else None]


def _equal(a: Grads | None, b: Grads | None) -> bool:
    if a is None or b is None:
        return a is b
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("units", [0, 1, 2, 3, 5, 7, 8, 13])
def test_every_degree_folds_to_the_bits_of_one_worker(units: int) -> None:
    one = fold_tree(0, units, _unit)
    for degree in DEGREES:
        ranges = [unit_range(units, degree, r) for r in range(degree)]
        assert [i for r in ranges for i in r] == list(range(units))  # contiguous, in rank order, complete
        partials = [fold_tree(r.start, r.stop, _unit) for r in ranges]
        assert _equal(fold_levels(partials), one), degree


def test_the_tree_is_not_a_left_fold() -> None:
    """The tree's order is part of the contract: 3 units fold as u0 + (u1 + u2)."""
    u = [_unit(i) for i in range(3)]
    assert _equal(fold_tree(0, 3, u.__getitem__), add(u[0], add(u[1], u[2])))


@pytest.mark.parametrize("degree", [0, 3, 6, -2])
def test_degree_must_be_a_power_of_two(degree: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        unit_range(4, degree, 0)


def test_rank_must_be_below_the_degree() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        unit_range(4, 2, 2)
