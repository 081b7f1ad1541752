"""Hardware tests of the Ascend backend (Atlas 800 A2/A3 with CANN, torch_npu and the onpolicy
operators installed; docs/ascend.md gives the steps). Skipped elsewhere.

* bitwise train/infer parity of the Ascend C attention: training forward vs prefill alone vs
  chunked prefill and paged decode over a shuffled paged cache (fp32 and bf16, GQA 1/2/4, lengths
  crossing the KV tile);
* bitwise batch invariance of matmul / RMSNorm / log-softmax (row alone vs inside batches);
* deterministic, reference-close gradients of the training attention;
* ``run_selftest`` and ``onpolicy selftest --backend ascend`` certify the backend;
* accuracy of every operator against the reference backend (tolerances, not bits: the NPU's exp,
  division and GEMM micro-order differ from the CPU's);
* the deterministic environment is in force.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from ascend_cpu_support import paged_cache

from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, PagedKV, get_backend
from onpolicy.kernels.selftest import ProbeShapes, run_selftest

NPU_REASON = "needs an Ascend NPU with CANN and torch_npu"

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason=NPU_REASON)]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ascend(**changes) -> object:
    from onpolicy.kernels.ascend import AscendBackend

    return AscendBackend(KernelConfig(backend="ascend", **changes))


def reference(**changes) -> object:
    return get_backend(KernelConfig(**changes))


@pytest.fixture(scope="module")
def npu() -> torch.device:
    import torch_npu  # noqa: F401

    if torch.npu.device_count() < 1:
        pytest.skip(NPU_REASON)
    return torch.device("npu", 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_train_infer_bitwise_parity(npu, dtype, group) -> None:
    kv_tile, hkv, d = 64, 2, 128
    be = ascend(kv_tile=kv_tile, compute_dtype=dtype)
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(group)
    lens = [1, kv_tile - 1, kv_tile, kv_tile + 1, 2 * kv_tile + 3, 300]
    n = sum(lens)
    q = torch.randn(n, hkv * group, d, generator=gen).to(dt).to(npu)
    k = torch.randn(n, hkv, d, generator=gen).to(dt)
    v = torch.randn(n, hkv, d, generator=gen).to(dt)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    scale = d ** -0.5
    train = be.attention(q, ContiguousKV(k.to(npu), v.to(npu), cu), AttentionBatch.build(lens, [0] * 6, lens), scale)
    for s, ln in enumerate(lens):  # prefill alone
        sl = slice(int(cu[s]), int(cu[s + 1]))
        one = be.attention(q[sl], ContiguousKV(k[sl].to(npu), v[sl].to(npu), torch.tensor([0, ln])),
                           AttentionBatch.build([ln], [0], [ln]), scale)
        assert torch.equal(one, train[sl]), f"prefill alone seq {s}"
    kp, vp, table = paged_cache(k, v, lens, 2 * kv_tile, gen)
    kp, vp = kp.to(npu), vp.to(npu)
    for chunk in (1, kv_tile - 1, kv_tile + 5):  # chunked prefill over the paged cache
        starts = [min(x - 1, chunk) for x in lens]
        idx = torch.cat([torch.arange(int(cu[i]) + st, int(cu[i + 1])) for i, st in enumerate(starts)])
        out = be.attention(q[idx.to(npu)], PagedKV(kp, vp, table),
                           AttentionBatch.build([x - st for x, st in zip(lens, starts, strict=True)], starts, lens),
                           scale)
        assert torch.equal(out, train[idx.to(npu)]), f"chunked prefill from {chunk}"
    for t in sorted({0, kv_tile - 1, kv_tile, kv_tile + 1, 2 * kv_tile + 2, 299}):  # paged decode, mixed batch
        seqs = [s for s, x in enumerate(lens) if x > t]
        idx = torch.tensor([int(cu[s]) + t for s in seqs]).to(npu)
        out = be.attention(q[idx], PagedKV(kp, vp, table[seqs]),
                           AttentionBatch.build([1] * len(seqs), [t] * len(seqs), [t + 1] * len(seqs)), scale)
        assert torch.equal(out, train[idx]), f"decode step {t}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_accuracy_against_reference(npu, dtype) -> None:
    be, ref, dt = ascend(compute_dtype=dtype), reference(compute_dtype=dtype), DTYPES[dtype]
    gen = torch.Generator().manual_seed(3)
    lens = [7, 64, 129]
    q = torch.randn(200, 8, 64, generator=gen).to(dt)
    k = torch.randn(200, 2, 64, generator=gen).to(dt)
    v = torch.randn(200, 2, 64, generator=gen).to(dt)
    kv, batch = ContiguousKV(k, v, torch.tensor([0, 7, 71, 200])), AttentionBatch.build(lens, [0, 0, 0], lens)
    got = be.attention(q.to(npu), ContiguousKV(k.to(npu), v.to(npu), kv.cu_seqlens), batch, 0.125).cpu()
    want = ref.attention(q, kv, batch, 0.125)
    tol = {"fp32": (1e-4, 1e-5), "bf16": (1.6e-2, 1e-2)}[dtype]
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])


def test_attention_gradients_are_deterministic_and_close_to_reference(npu) -> None:
    be, ref = ascend(), reference()
    gen = torch.Generator().manual_seed(4)
    lens = [33, 100]
    base = [torch.randn(133, h, 64, generator=gen) for h in (4, 2, 2)]
    cu = torch.tensor([0, 33, 133])
    batch = AttentionBatch.build(lens, [0, 0], lens)

    def grads(backend, device):
        q, k, v = (t.to(device).requires_grad_() for t in base)
        out = backend.attention(q, ContiguousKV(k, v, cu), batch, 0.125)
        (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        return [t.grad.cpu() for t in (q, k, v)]

    first, second = grads(be, npu), grads(be, npu)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "attention backward is not deterministic"
    for a, b in zip(first, grads(ref, "cpu"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_operators_are_batch_invariant_and_accurate(npu, dtype) -> None:
    be, ref, dt = ascend(compute_dtype=dtype), reference(compute_dtype=dtype), DTYPES[dtype]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 512, generator=gen).to(dt)
    w = (torch.randn(1000, 512, generator=gen) * 0.05).to(dt)
    nw = (torch.randn(512, generator=gen) + 1).to(dt)
    temp = torch.rand(37, generator=gen) + 0.5
    ops = {
        "linear": (lambda a, t: be.linear(a, w.to(npu)), lambda a, t: ref.linear(a, w)),
        "rmsnorm": (lambda a, t: be.rmsnorm(a, nw.to(npu), 1e-6), lambda a, t: ref.rmsnorm(a, nw, 1e-6)),
        "logprobs": (lambda a, t: be.logprobs(a, w.to(npu), t), lambda a, t: ref.logprobs(a, w, t)),
    }
    tol = {"fp32": (1e-4, 1e-4), "bf16": (1.6e-2, 2e-2)}[dtype]
    for name, (f, g) in ops.items():
        full = f(x.to(npu), temp.to(npu))
        for m in (1, 2, 3, 8, 13, 31):
            assert torch.equal(f(x[:m].to(npu), temp[:m].to(npu)), full[:m]), f"{name}: batch {m}"
        for i in (0, 17, 36):
            assert torch.equal(f(x[i:i + 1].to(npu), temp[i:i + 1].to(npu)), full[i:i + 1]), f"{name}: row {i}"
        torch.testing.assert_close(full.cpu().float(), g(x, temp).float(), rtol=tol[0], atol=tol[1])


def test_selftest_certifies_ascend(npu) -> None:
    config = KernelConfig(backend="ascend")  # the registry builds the AscendBackend
    report = run_selftest(config, ProbeShapes(hidden=256, num_heads=8, num_kv_heads=2, head_dim=64,
                                              intermediate=512, vocab=1024))
    assert report.certified, [(p.name, p.detail) for p in report.probes if not p.passed]


def test_cli_selftest_backend_ascend(npu, tmp_path) -> None:
    env = {**os.environ, "ONPOLICY_HOME": os.environ.get("ONPOLICY_HOME", str(tmp_path))}
    done = subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "selftest", "--backend", "ascend",
                           "--model", "tiny-llama"], capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "CERTIFIED" in done.stdout


def test_deterministic_environment_is_applied(npu) -> None:
    from onpolicy.kernels.ascend import Provider, env_mismatches

    be = ascend()
    assert env_mismatches() == {}
    assert be.provider in (Provider.ONPOLICY, Provider.VENDOR)
    if os.environ.get("ONPOLICY_ASCEND_OPS", "auto") in ("auto", "onpolicy"):
        assert be.provider is Provider.ONPOLICY, "torch.ops.onpolicy is not loaded: build kernels/ascendc first"
