"""The candidate single-chain order that ``python -m onpolicy.bench.gemm`` measures against rowdot
(``bench/outer_gemm.c``; not the contract's linear): each output is one fused multiply-add chain over
k = 0..K-1 from +0, so its bits are the same on the AVX2 and portable paths, for any rows, threads,
K blocks or packing — and a split K or rowdot's lane tree gives other bits (negative controls)."""

from __future__ import annotations

import pytest
import torch

from onpolicy.bench import gemm
from onpolicy.kernels import cpu

needs_vector = pytest.mark.skipif(not cpu.vector_path(), reason="the candidate's vector path is AVX2+FMA")
# K past one packed block (192) and past a multiple of it; N and M remainders of the panel and tile
SHAPES = [(1, 1, 1), (5, 17, 7), (7, 40, 9), (13, 15, 200), (6, 200, 577), (1, 33, 384), (3, 96, 64)]


def operands(m: int, n: int, k: int, wd: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).to(wd)


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One element's documented order in Python: fma(x[k], w[k], acc) for k ascending from +0 (the
    fp32 product is exact in fp64; the fp64 sum rounded to fp32)."""
    acc = torch.tensor(0.0)
    for a, b in zip(x.double().tolist(), w.double().tolist(), strict=True):
        acc = torch.tensor(a * b + float(acc), dtype=torch.float64).float()
    return acc


@needs_vector
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16])
def test_bits_do_not_depend_on_path_rows_threads_or_packing(m, n, k, wd) -> None:
    x, w = operands(m, n, k, wd, m * 100 + n + k)
    y = gemm.outer_gemm(x, w, threads=2)
    assert torch.equal(y, gemm.outer_gemm(x, w, portable=True))
    assert torch.equal(y, gemm.outer_gemm(x, w, threads=1))
    assert torch.equal(y, torch.cat([gemm.outer_gemm(x[i:i + 1], w) for i in range(m)]))
    assert torch.equal(y, torch.cat([gemm.outer_gemm(x, w[a:a + 16]) for a in range(0, n, 16)], 1))
    assert torch.equal(y[:4], gemm.outer_gemv_packed(x[:4], gemm.outer_pack(w), n, threads=2))
    assert torch.allclose(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_the_order_is_one_chain_over_k() -> None:
    x, w = operands(2, 3, 37, torch.float32, 5)
    y = gemm.outer_gemm(x, w)
    for i in range(2):
        for j in range(3):
            assert torch.equal(y[i, j], chain(x[i], w[j]))


@needs_vector
def test_a_split_k_or_rowdots_lane_tree_gives_other_bits() -> None:
    """Negative controls: the tests above would see an order change."""
    x, w = operands(64, 256, 576, torch.float32, 9)
    y = gemm.outer_gemm(x, w)
    split = gemm.outer_gemm(x[:, :288].contiguous(), w[:, :288].contiguous()) + gemm.outer_gemm(
        x[:, 288:].contiguous(), w[:, 288:].contiguous())
    assert not torch.equal(y, split)
    assert not torch.equal(y, cpu.rowdot(x, w))
