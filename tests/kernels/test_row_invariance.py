"""The invariance rule for every row-wise operator of the reference backend (docs/numerics.md).

For each op an output row must be bitwise the same (``torch.equal``) whatever the number of rows in
the call, the row's position, the other rows' contents and the intra-op thread count — in fp32 and
in bf16. Hypothesis draws the batch sizes, positions and data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.selftest import num_threads
from onpolicy.models.causal_lm import rope_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, EXPERTS, TOP_K = 64, 4, 16, 128, 320, 8, 2




def thread_counts() -> list[int]:
    """1 thread, the default, and 2 (so the check is not vacuous where the default is 1)."""
    return sorted({1, 2, torch.get_num_threads()})


@dataclass
class RowOp:
    """A row-wise op: ``make(n, gen, dtype)`` draws n input rows (a tuple of tensors sharing dim 0),
    ``fn(ops, *rows)`` applies the op and returns a tuple of per-row outputs."""

    make: Callable[[int, torch.Generator, torch.dtype], tuple[Tensor, ...]]
    fn: Callable[..., tuple[Tensor, ...]]
    max_rows: int = 40


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=gen) * scale


_W = torch.Generator().manual_seed(99)
WEIGHTS = {
    "qkv": _rand(_W, (HEADS + 2 * 2) * HEAD_DIM, HIDDEN, scale=0.05),
    "down": _rand(_W, HIDDEN, INTER, scale=0.05),
    "lm_head": _rand(_W, VOCAB, HIDDEN, scale=0.05),
    "norm": _rand(_W, HIDDEN) + 1,
    "head_norm": _rand(_W, HEAD_DIM) + 1,
}
COS, SIN = rope_table(HEAD_DIM, 1_000_000.0, 4096)


def _w(name: str, dtype: torch.dtype) -> Tensor:
    return WEIGHTS[name].to(dtype)


def _positions(n: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, COS.shape[0], (n,), generator=gen)


OPS: dict[str, RowOp] = {
    "linear/qkv": RowOp(
        lambda n, g, dt: (_rand(g, n, HIDDEN).to(dt),),
        lambda ops, x: (ops.linear(x, _w("qkv", x.dtype)),), max_rows=70),
    "linear/down": RowOp(
        lambda n, g, dt: (_rand(g, n, INTER).to(dt),),
        lambda ops, x: (ops.linear(x, _w("down", x.dtype)),), max_rows=70),
    "rmsnorm": RowOp(
        lambda n, g, dt: (_rand(g, n, HIDDEN, scale=3).to(dt),),
        lambda ops, x: (ops.rmsnorm(x, _w("norm", x.dtype), 1e-6),)),
    "rmsnorm/per-head": RowOp(
        lambda n, g, dt: (_rand(g, n, HEADS, HEAD_DIM, scale=3).to(dt),),
        lambda ops, x: (ops.rmsnorm(x, _w("head_norm", x.dtype), 1e-6),)),
    "rope": RowOp(  # cos/sin rows from the model's real fp32 table at random absolute positions
        lambda n, g, dt: (_rand(g, n, HEADS, HEAD_DIM).to(dt), _positions(n, g)),
        lambda ops, x, pos: (ops.rope(x, COS[pos], SIN[pos]),)),
    "swiglu": RowOp(
        lambda n, g, dt: (_rand(g, n, INTER, scale=4).to(dt), _rand(g, n, INTER, scale=4).to(dt)),
        lambda ops, gate, up: (ops.swiglu(gate, up),)),
    "logprobs": RowOp(  # lm head + log-softmax at a per-row temperature
        lambda n, g, dt: (_rand(g, n, HIDDEN).to(dt), torch.rand(n, generator=g) * 1.7 + 0.05),
        lambda ops, h, t: (ops.logprobs(h, _w("lm_head", h.dtype), t),)),
    "moe_route": RowOp(  # weights and expert ids; integer logits make exact ties common
        lambda n, g, dt: (_rand(g, n, EXPERTS, scale=2).round().to(dt),),
        lambda ops, logits: _route(ops, logits)),
    "moe_combine": RowOp(
        lambda n, g, dt: (_rand(g, n, TOP_K, HIDDEN).to(dt), torch.softmax(_rand(g, n, TOP_K), -1),
                          torch.randint(0, EXPERTS, (n, TOP_K), generator=g)),
        lambda ops, out, w, e: (ops.moe_combine(out, _routing(w, e)),)),
}


def _route(ops: object, logits: Tensor) -> tuple[Tensor, ...]:
    r = ops.moe_route(logits, TOP_K, True)  # type: ignore[attr-defined]
    r_raw = ops.moe_route(logits, TOP_K, False)  # type: ignore[attr-defined]
    return r.weights, r.experts, r_raw.weights


def _routing(weights: Tensor, experts: Tensor) -> object:
    from onpolicy.kernels import MoERouting

    return MoERouting(weights=weights, experts=experts)


def _assert_rows_equal(got: tuple[Tensor, ...], want: tuple[Tensor, ...], what: str) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max |diff| {(a.double() - b.double()).abs().max().item()}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op_name", list(OPS))
@settings(max_examples=15)
@given(data=st.data())
def test_row_invariance(op_name: str, dtype: str, data: st.DataObject) -> None:
    op, dt = OPS[op_name], DTYPES[dtype]
    ops = get_backend(KernelConfig(compute_dtype=dtype))
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    n = data.draw(st.integers(1, op.max_rows), label="rows")
    x = op.make(n, gen, dt)
    full = op.fn(ops, *x)
    assert all(o.shape[0] == n for o in full)

    # the leading rows alone (any batch size) equal the same rows of the full call
    m = data.draw(st.integers(1, n), label="prefix")
    _assert_rows_equal(op.fn(ops, *(t[:m] for t in x)), tuple(o[:m] for o in full), f"prefix of {m}/{n}")

    # row i alone
    i = data.draw(st.integers(0, n - 1), label="row")
    _assert_rows_equal(op.fn(ops, *(t[i:i + 1] for t in x)), tuple(o[i:i + 1] for o in full), f"row {i} alone")

    # row i at position j among m2 other random rows
    m2 = data.draw(st.integers(1, op.max_rows), label="other batch")
    j = data.draw(st.integers(0, m2 - 1), label="position")
    others = op.make(m2, gen, dt)
    for t_other, t in zip(others, x, strict=True):
        t_other[j] = t[i]
    moved = op.fn(ops, *others)
    _assert_rows_equal(tuple(o[j:j + 1] for o in moved), tuple(o[i:i + 1] for o in full),
                       f"row {i} at position {j} of {m2}")

    # thread count
    for threads in thread_counts():
        with num_threads(threads):
            _assert_rows_equal(op.fn(ops, *x), full, f"{threads} threads")


# ---------------------------------------------------------------------------------- moe_route semantics


@pytest.mark.parametrize("dtype", list(DTYPES))
@settings(max_examples=20)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 30), experts=st.integers(2, 16), data=st.data())
def test_moe_route_ties_go_to_lower_expert_id(dtype: str, seed: int, n: int, experts: int,
                                              data: st.DataObject) -> None:
    top_k = data.draw(st.integers(1, experts), label="top_k")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (n, experts), generator=gen).to(DTYPES[dtype])  # many exact ties
    ops = get_backend(KernelConfig(compute_dtype=dtype))
    r = ops.moe_route(logits, top_k, False)
    probs = torch.softmax(logits.float(), dim=-1)
    for row in range(n):
        p = probs[row].tolist()
        want = sorted(range(experts), key=lambda e, p=p: (-p[e], e))[:top_k]
        assert r.experts[row].tolist() == want
        assert torch.equal(r.weights[row], probs[row, want])
    assert r.weights.dtype == torch.float32 and r.experts.dtype == torch.int64


def test_moe_route_all_equal_logits_pick_first_ids() -> None:
    ops = get_backend(KernelConfig())
    r = ops.moe_route(torch.zeros(5, 8), 3, True)
    assert r.experts.tolist() == [[0, 1, 2]] * 5
    assert torch.equal(r.weights, torch.full((5, 3), 1 / 3))


def test_moe_route_normalised_weights_sum_to_one() -> None:
    ops = get_backend(KernelConfig())
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    r = ops.moe_route(logits, 2, True)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(50))
    raw = ops.moe_route(logits, 2, False)
    assert torch.equal(raw.experts, r.experts)
    assert torch.equal(r.weights, raw.weights / raw.weights.sum(-1, keepdim=True))


def test_moe_combine_is_rank_ordered_fp32_sum() -> None:
    """combine = ((o0 * w0) + o1 * w1) + ... in fp32, cast once to the compute dtype."""
    from onpolicy.kernels import MoERouting

    gen = torch.Generator().manual_seed(5)
    out = torch.randn(7, 3, HIDDEN, generator=gen).bfloat16()
    w = torch.softmax(torch.randn(7, 3, generator=gen), -1)
    got = get_backend(KernelConfig(compute_dtype="bf16")).moe_combine(out, MoERouting(w, torch.zeros(7, 3).long()))
    acc = out[:, 0].float() * w[:, :1]
    acc = acc + out[:, 1].float() * w[:, 1:2]
    acc = acc + out[:, 2].float() * w[:, 2:3]
    assert torch.equal(got, acc.bfloat16())


def test_logprobs_are_fp32_log_softmax_at_temperature() -> None:
    gen = torch.Generator().manual_seed(11)
    h, lm = torch.randn(9, HIDDEN, generator=gen).bfloat16(), _w("lm_head", torch.bfloat16)
    t = torch.tensor([0.3, 0.7, 1.0, 1.3, 2.0, 0.05, 1.0, 1.0, 0.9])
    lp = get_backend(KernelConfig(compute_dtype="bf16")).logprobs(h, lm, t)
    assert lp.dtype == torch.float32 and lp.shape == (9, VOCAB)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(9))
    ref = torch.log_softmax((h.double() @ lm.double().T) / t[:, None].double(), -1)
    torch.testing.assert_close(lp.double(), ref, atol=2e-5, rtol=0)
