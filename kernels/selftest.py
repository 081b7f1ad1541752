"""Certify a backend on this machine: bitwise invariance probes on real random data.

Each probe computes rows (or attention outputs) one way and another — alone and inside batches of
1…N other rows at random positions, at 1 thread and at the default count, via training / prefill /
chunked-prefill / paged-decode attention, via vectorised and scalar elementwise loops — and checks
``torch.equal``. A backend is certified for a shape set only if every probe passes; the report is
saved so services can refuse to start on an uncertified backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from onpolicy.home import onpolicy_home

from . import cpu
from .backend import SINGLE, Backend, chunk_major, fold_chunks
from .config import KernelConfig
from .kv import AttentionBatch, ContiguousKV, PagedKV
from .registry import get_backend
from .sampling import sample


@dataclass(frozen=True, kw_only=True)
class ProbeShapes:
    """The shapes of the model the backend is certified for."""

    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 320
    num_experts: int = 8
    top_k: int = 2


@dataclass
class ProbeResult:
    name: str
    passed: bool
    checked: int
    detail: str = ""


@dataclass
class SelftestReport:
    backend: str
    fingerprint: str
    shapes: ProbeShapes
    machine: dict[str, object]
    probes: list[ProbeResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def certified(self) -> bool:
        return bool(self.probes) and all(p.passed for p in self.probes)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["certified"] = self.certified
        return d


def machine_info() -> dict[str, object]:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, restoring the previous count afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


BATCH_SIZES = (1, 2, 3, 5, 8, 13, 31, 64)


def _rows_probe(name: str, f: Callable[[Tensor], Tensor], x: Tensor, gen: torch.Generator) -> ProbeResult:
    """Row invariance of a row-wise op: batch size, row position, other rows, thread count."""
    full = f(x)
    checked, failures = 0, []
    for m in BATCH_SIZES:
        if m > x.shape[0]:
            break
        checked += 1
        if not torch.equal(f(x[:m]), full[:m]):
            failures.append(f"batch {m}")
    for _ in range(4):  # row i placed at a random position among other random rows
        i = int(torch.randint(0, x.shape[0], (1,), generator=gen))
        m = int(torch.randint(2, x.shape[0] + 1, (1,), generator=gen))
        j = int(torch.randint(0, m, (1,), generator=gen))
        others = torch.randn((m, *x.shape[1:]), generator=gen).to(x.dtype)
        others[j] = x[i]
        checked += 1
        if not torch.equal(f(others)[j], full[i]):
            failures.append(f"row {i} at position {j} of {m}")
    with num_threads(1):
        one = f(x)
    checked += 1
    if not torch.equal(one, full):
        failures.append("1 thread vs default")
    return ProbeResult(name, not failures, checked, "; ".join(failures[:4]))


def _elementwise_paths() -> ProbeResult:
    """exp/log vectorised body vs scalar loop (strided input) vs single element."""
    gen = torch.Generator().manual_seed(7)
    failures, checked = [], 0
    for name, f, lo, hi in (("exp", torch.exp, -90.0, 0.0), ("log", torch.log, 1e-30, 1.0)):
        x = torch.rand(400_002, generator=gen) * (hi - lo) + lo
        vec = f(x[::2].contiguous())
        strided = f(x[::2])
        single = torch.stack([f(x[2 * i:2 * i + 1])[0] for i in range(0, 200_001, 997)])
        checked += 2
        if not torch.equal(vec, strided):
            failures.append(f"{name}: vector vs scalar loop differ on {(vec != strided).sum().item()} values")
        if not torch.equal(vec[::997], single):
            failures.append(f"{name}: single-element calls differ")
    return ProbeResult("elementwise/exp-log-paths", not failures, checked, "; ".join(failures))


def _attention_probe(ops: Backend, s: ProbeShapes, dtype: torch.dtype, gen: torch.Generator) -> list[ProbeResult]:
    tile = ops.config.kv_tile
    lens = [n for n in (1, tile - 1, tile, tile + 1, 2 * tile + 3, 3) if n >= 1]
    n = sum(lens)
    q = torch.randn(n, s.num_heads, s.head_dim, generator=gen).to(dtype)
    k = torch.randn(n, s.num_kv_heads, s.head_dim, generator=gen).to(dtype)
    v = torch.randn(n, s.num_kv_heads, s.head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    scale = s.head_dim ** -0.5
    train = ops.attention(q, ContiguousKV(k, v, cu), AttentionBatch.build(lens, [0] * len(lens), lens), scale)
    # paged cache holding every sequence (pages scattered, page = 2 KV tiles)
    page = 2 * tile
    pages_per = [-(-n_ // page) for n_ in lens]
    total = sum(pages_per) + 1
    perm = torch.randperm(total, generator=gen).tolist()
    kp = torch.zeros(total, page, s.num_kv_heads, s.head_dim, dtype=dtype)
    vp = torch.zeros_like(kp)
    table = torch.zeros(len(lens), max(pages_per), dtype=torch.int64)
    used = 0
    for i, ln in enumerate(lens):
        for p in range(pages_per[i]):
            table[i, p] = perm[used]
            used += 1
        for pos in range(ln):
            kp[table[i, pos // page], pos % page] = k[cu[i] + pos]
            vp[table[i, pos // page], pos % page] = v[cu[i] + pos]
    results = []
    checked, fails = 0, []
    for i, ln in enumerate(lens):  # prefill each sequence alone
        one = ops.attention(q[cu[i]:cu[i + 1]], ContiguousKV(k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]],
                            torch.tensor([0, ln])), AttentionBatch.build([ln], [0], [ln]), scale)
        checked += 1
        if not torch.equal(one, train[cu[i]:cu[i + 1]]):
            fails.append(f"seq {i} (len {ln})")
    results.append(ProbeResult("attention/prefill-vs-training", not fails, checked, "; ".join(fails)))
    checked, fails = 0, []
    for i, ln in enumerate(lens):  # paged decode, one position at a time, all sequences batched
        for pos in range(ln):
            b = AttentionBatch.build([1], [pos], [pos + 1])
            out = ops.attention(q[cu[i] + pos:cu[i] + pos + 1], PagedKV(kp, vp, table[i:i + 1]), b, scale)
            checked += 1
            if not torch.equal(out[0], train[cu[i] + pos]):
                fails.append(f"seq {i} pos {pos}")
    results.append(ProbeResult("attention/paged-decode-vs-training", not fails, checked, "; ".join(fails[:4])))
    checked, fails = 0, []
    for chunk in (1, 3, tile - 1, tile + 5):  # chunked prefill of all sequences together over the cache
        q_lens, starts, rows = [], [], []
        for i, ln in enumerate(lens):
            start = min(ln - 1, chunk)
            q_lens.append(ln - start)
            starts.append(start)
            rows.append(torch.arange(cu[i] + start, cu[i + 1]))
        idx = torch.cat(rows)
        b = AttentionBatch.build(q_lens, starts, lens)
        out = ops.attention(q[idx], PagedKV(kp, vp, table), b, scale)
        checked += 1
        if not torch.equal(out, train[idx]):
            fails.append(f"chunk start {chunk}")
    results.append(ProbeResult("attention/chunked-prefill-paged-vs-training", not fails, checked, "; ".join(fails)))
    with num_threads(1):
        one = ops.attention(q, ContiguousKV(k, v, cu), AttentionBatch.build(lens, [0] * len(lens), lens), scale)
    results.append(ProbeResult("attention/threads", torch.equal(one, train), 1,
                               "" if torch.equal(one, train) else "1 thread vs default"))
    return results


TP_DEGREES = (1, 2, 4)


class _ChunkedWeight:
    """A row-parallel weight shard as the model holds it (``RowWeight``)."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight

    def chunked(self, chunks: int) -> Tensor:
        return chunk_major(self.weight, chunks)


class _OneRank:
    """Stands in for one rank of a TP group inside this process: records the rank's partials (the
    probe folds all ranks' partials itself) and returns them repeated so the shapes work out."""

    def __init__(self, degree: int, index: int, parts: dict[int, Tensor]) -> None:
        self.degree, self.index, self.parts = degree, index, parts

    def gather(self, t: Tensor) -> Tensor:
        self.parts[self.index] = t
        return torch.cat([t] * self.degree)

    def all_reduce(self, t: Tensor) -> Tensor:
        return t

    def enter(self, t: Tensor) -> Tensor:
        return t


def _row_parallel_probe(ops: Backend, name: str, w: Tensor, x: Tensor) -> ProbeResult:
    """Canonical reduction: each rank's chunk partials, computed from its weight shard, folded in
    chunk order, equal the degree-1 result — for every TP degree dividing ``reduce_chunks``."""
    chunks = ops.config.reduce_chunks
    full = ops.row_linear(x, _ChunkedWeight(w), SINGLE)
    checked, fails = 0, []
    for t in TP_DEGREES:
        if chunks % t or w.shape[1] % chunks:
            continue
        k = w.shape[1] // t
        parts: dict[int, Tensor] = {}
        for r in range(t):
            ops.row_linear(x[:, r * k:(r + 1) * k].contiguous(), _ChunkedWeight(w[:, r * k:(r + 1) * k].contiguous()),
                           _OneRank(t, r, parts))
        checked += 1
        if len(parts) < t:
            fails.append(f"tp {t}: no canonical gather of partials")
        elif not torch.equal(fold_chunks(torch.cat([parts[r] for r in range(t)])).to(x.dtype), full):
            fails.append(f"tp {t}")
    return ProbeResult(f"row-parallel/{name}", not fails, checked, "; ".join(fails))


def _column_parallel_probe(ops: Backend, name: str, w: Tensor, x: Tensor, units: int) -> ProbeResult:
    """Column slices: ``linear(x, W[a:b]) == linear(x, W)[:, a:b]`` for each TP degree's slices.
    The output dim is ``units`` equal blocks (heads, or columns); a slice is never narrower than one
    block (KV heads are replicated, not split, when the degree exceeds them)."""
    full = ops.linear(x, w)
    checked, fails = 0, []
    for t in TP_DEGREES:
        if units % t and t % units:
            continue
        n = w.shape[0] // min(t, units)
        for r in range(min(t, units)):
            checked += 1
            if not torch.equal(ops.linear(x, w[r * n:(r + 1) * n].contiguous()), full[:, r * n:(r + 1) * n]):
                fails.append(f"tp {t} shard {r}")
    return ProbeResult(f"column-parallel/{name}", not fails, checked, "; ".join(fails[:4]))


def _head_slice_probe(ops: Backend, s: ProbeShapes, dtype: torch.dtype, gen: torch.Generator) -> ProbeResult:
    """Attention over a TP rank's heads (KV heads replicated when the degree exceeds them) equals
    those heads of the full attention, on the training path and in paged decode."""
    tile = ops.config.kv_tile
    lens = [3, tile + 5]
    n = sum(lens)
    q = torch.randn(n, s.num_heads, s.head_dim, generator=gen).to(dtype)
    k = torch.randn(n, s.num_kv_heads, s.head_dim, generator=gen).to(dtype)
    v = torch.randn(n, s.num_kv_heads, s.head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    batch = AttentionBatch.build(lens, [0] * len(lens), lens)
    scale = s.head_dim ** -0.5
    full = ops.attention(q, ContiguousKV(k, v, cu), batch, scale)
    group = s.num_heads // s.num_kv_heads
    checked, fails = 0, []
    for t in TP_DEGREES:
        if s.num_heads % t or (s.num_kv_heads % t and t % s.num_kv_heads):
            continue
        hq = s.num_heads // t
        hkv = s.num_kv_heads // t if t <= s.num_kv_heads else 1
        for r in range(t):
            kv0 = r * hkv if t <= s.num_kv_heads else r * hq // group
            qs, ks, vs = (q[:, r * hq:(r + 1) * hq].contiguous(), k[:, kv0:kv0 + hkv].contiguous(),
                          v[:, kv0:kv0 + hkv].contiguous())
            checked += 1
            if not torch.equal(ops.attention(qs, ContiguousKV(ks, vs, cu), batch, scale), full[:, r * hq:(r + 1) * hq]):
                fails.append(f"tp {t} shard {r}")
            last = n - 1  # the last row again, as one paged decode step over a one-page cache per sequence
            page = -(-lens[-1] // tile) * tile
            kp = torch.zeros(1, page, hkv, s.head_dim, dtype=dtype)
            vp = torch.zeros_like(kp)
            kp[0, :lens[-1]], vp[0, :lens[-1]] = ks[cu[-2]:], vs[cu[-2]:]
            one = ops.attention(qs[last:last + 1], PagedKV(kp, vp, torch.zeros(1, 1, dtype=torch.int64)),
                                AttentionBatch.build([1], [lens[-1] - 1], [lens[-1]]), scale)
            checked += 1
            if not torch.equal(one[0], full[last, r * hq:(r + 1) * hq]):
                fails.append(f"tp {t} shard {r} decode")
    return ProbeResult("attention/head-slices", not fails, checked, "; ".join(fails[:4]))


def _lm_head_grad_probe(ops: Backend, s: ProbeShapes, dtype: torch.dtype, gen: torch.Generator) -> ProbeResult:
    """The LM head + log-softmax without autograd (rollout, scoring) vs with it (training forward):
    the two run different code (a plain call vs an autograd function) and must give the same bits."""
    lm = (torch.randn(2348, s.hidden, generator=gen) * 0.05).to(dtype)
    fails, checked = [], 0
    for m in (1, 8, 13, 64):
        x = torch.randn(m, s.hidden, generator=gen).to(dtype)
        t = torch.rand(m, generator=gen) + 0.3
        with torch.no_grad():
            plain = ops.logprobs(x, lm, t)
        with torch.enable_grad():
            trained = ops.logprobs(x.clone().requires_grad_(), lm, t).detach()
        checked += 1
        if not torch.equal(plain, trained):
            fails.append(f"{m} rows")
    return ProbeResult("logprobs/no-grad-vs-autograd", not fails, checked, "; ".join(fails))


def _native_paths_probe(dtype: torch.dtype, gen: torch.Generator) -> ProbeResult:
    """rowdot's vector path (when this CPU runs it) gives the bits of its portable path, and one
    thread the bits of several: the order of additions is the algorithm's, not the machine's.
    Shapes cover K and N remainders of every micro-tile, bf16 and mixed operands; the packed fp32
    and bf16 weights (vector path only) give rowdot's bits, folded chunks included."""
    fails, checked = [], 0
    for m, n, k in ((1, 7, 5), (3, 33, 64), (5, 96, 97), (8, 193, 576), (70, 40, 129)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for w in (torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).bfloat16()):
            got = cpu.rowdot(x, w)
            checked += 2
            if not torch.equal(got, cpu.rowdot(x, w, portable=True)):
                fails.append(f"vector vs portable {m}x{n}x{k} {w.dtype}")
            if not torch.equal(got, cpu.rowdot(x, w, threads=1)):
                fails.append(f"1 thread vs {torch.get_num_threads()} {m}x{n}x{k} {w.dtype}")
    if cpu.vector_path():  # the packed weights a decode step reads (decoder_stack)
        for (m, n, k, c), wd in itertools.product(((1, 7, 32, 1), (3, 97, 64, 4), (4, 40, 576, 4)),
                                                  (dtype, torch.bfloat16)):
            x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(wd)
            chunks = w.view(n, c, k // c).transpose(0, 1).contiguous()
            round_bf16 = dtype == torch.bfloat16
            want = cpu.rowdot_chunks(x, chunks, fold=True, round_bf16=round_bf16)
            got = cpu.rowdot_packed(x, [(cpu.pack(w, c), n)], chunks=c, round_bf16=round_bf16)[0]
            checked += 1
            if not torch.equal(got, want):
                fails.append(f"packed {wd} vs rowdot {m}x{n}x{k}, {c} chunks")
    path = "vector (AVX2+FMA)" if cpu.vector_path() else "portable only"
    return ProbeResult("linear/rowdot-paths", not fails, checked, "; ".join(fails[:4]) or path)


def _native_rows_probe(dtype: torch.dtype, gen: torch.Generator) -> ProbeResult:
    """The other native kernels, likewise: attention (paged-style index, GQA, a partial last tile and
    a zero-padded lane block), RMSNorm and SwiGLU give the same bits on the vector and portable paths
    and on one thread or several; so does exp_ itself."""
    from .cpu import attention as na
    from .cpu import rowwise

    fails, checked = [], 0

    def same(name: str, run: Callable[..., Tensor]) -> None:
        nonlocal checked
        got = run()
        for kw in ({"portable": True}, {"threads": 1}):
            checked += 1
            if not torch.equal(got, run(**kw)):
                fails.append(f"{name}: {next(iter(kw))}")

    n, hq, hkv, d, length = 40, 6, 2, 40, 40
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(length * hkv, d, generator=gen).to(dtype) for _ in range(2))
    idx = (torch.arange(length)[None, None, :] * hkv + torch.arange(hkv)[None, :, None]).contiguous()
    seq, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    same("attention", lambda **kw: na.attention_rows(q, k, v, idx, seq, pos, 0.2, 16, **kw))
    x, w = torch.randn(9, 67, generator=gen).to(dtype), torch.randn(67, generator=gen).to(dtype)
    same("rmsnorm", lambda **kw: rowwise.rmsnorm(x, w, 1e-6, **kw))
    gate, up = (torch.randn(9, 203, generator=gen).to(dtype) * 4 for _ in range(2))
    same("swiglu", lambda **kw: rowwise.swiglu(gate, up, **kw))
    e = torch.linspace(-90.0, 0.0, 1003)
    checked += 1
    if not torch.equal(na.exp(e), na.exp(e, portable=True)):
        fails.append("exp_: vector vs portable")
    return ProbeResult("native/attention-rowwise-paths", not fails, checked, "; ".join(fails[:4]))


def _sampling_probe(s: ProbeShapes, gen: torch.Generator) -> ProbeResult:
    b = 9
    lp = torch.log_softmax(torch.randn(b, s.vocab, generator=gen) * 3, -1)
    keys = torch.randint(-(2 ** 62), 2 ** 62, (b,), generator=gen)
    steps = torch.arange(b) * 3
    greedy = torch.tensor([False] * (b - 1) + [True])
    together = sample(lp, keys, steps, greedy)
    fails = [i for i in range(b) if not torch.equal(sample(lp[i:i + 1], keys[i:i + 1], steps[i:i + 1],
                                                           greedy[i:i + 1]), together[i:i + 1])]
    return ProbeResult("sampling/alone-vs-batch", not fails, b, f"rows {fails}" if fails else "")


def run_selftest(config: KernelConfig, shapes: ProbeShapes, progress: Callable[[str], None] | None = None,
                 backend: Backend | None = None) -> SelftestReport:
    """Probe ``backend`` (default: the registry's backend for ``config``) on this machine."""
    ops = backend or get_backend(config)
    t0 = time.perf_counter()
    report = SelftestReport(config.backend, config.fingerprint, shapes, machine_info())
    gen = torch.Generator().manual_seed(0)
    dt = config.dtype
    s = shapes

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dt)

    def add(result: ProbeResult | list[ProbeResult]) -> None:
        for r in result if isinstance(result, list) else [result]:
            report.probes.append(r)
            if progress:
                detail = f" {r.detail}" if r.detail else ""
                progress(f"{'ok  ' if r.passed else 'FAIL'} {r.name} ({r.checked} checks){detail}")

    add(_elementwise_paths())
    if config.backend == "reference":
        add(_native_paths_probe(dt, gen))
        add(_native_rows_probe(dt, gen))
    rows = 64
    linears = {"qkv": (s.hidden, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim),
               "o_proj": (s.num_heads * s.head_dim, s.hidden), "up": (s.hidden, s.intermediate),
               "down": (s.intermediate, s.hidden)}
    for lname, (k_in, k_out) in linears.items():
        w = rnd(k_out, k_in) * 0.05
        add(_rows_probe(f"linear/{lname}[{k_in}x{k_out}]", lambda a, w=w: ops.linear(a, w), rnd(rows, k_in), gen))
        if lname in ("o_proj", "down") and k_in % ops.config.reduce_chunks == 0:
            add(_rows_probe(f"row-linear/{lname}[{k_in}x{k_out}]",
                            lambda a, w=w: ops.row_linear(a, _ChunkedWeight(w)), rnd(rows, k_in), gen))
            add(_row_parallel_probe(ops, f"{lname}[{k_in}x{k_out}]", w, rnd(13, k_in)))
    qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim  # Qwen2's (and attention_bias') biased q/k/v
    wb, bias = rnd(qkv_out, s.hidden) * 0.05, rnd(qkv_out)
    add(_rows_probe(f"linear+bias/qkv[{s.hidden}x{qkv_out}]", lambda a: ops.linear(a, wb) + bias,
                    rnd(rows, s.hidden), gen))
    columns = {"q": (s.num_heads * s.head_dim, s.num_heads), "kv": (s.num_kv_heads * s.head_dim, s.num_kv_heads),
               "gate-up": (s.intermediate, s.intermediate)}
    for lname, (k_out, units) in columns.items():
        add(_column_parallel_probe(ops, f"{lname}[{s.hidden}x{k_out}]", rnd(k_out, s.hidden) * 0.05,
                                   rnd(13, s.hidden), units))
    nw = rnd(s.hidden) + 1
    add(_rows_probe("rmsnorm", lambda a: ops.rmsnorm(a, nw, 1e-6), rnd(rows, s.hidden), gen))
    hw = rnd(s.head_dim) + 1
    add(_rows_probe("rmsnorm/head", lambda a: ops.rmsnorm(a, hw, 1e-6), rnd(rows, s.num_heads, s.head_dim), gen))
    cos, sin = torch.rand(rows, s.head_dim, generator=gen), torch.rand(rows, s.head_dim, generator=gen)
    xr = rnd(rows, s.num_heads, s.head_dim)
    full_r = ops.rope(xr, cos, sin)
    ok = all(torch.equal(ops.rope(xr[i:i + 1], cos[i:i + 1], sin[i:i + 1]), full_r[i:i + 1]) for i in range(rows))
    add(ProbeResult("rope", ok, rows, "" if ok else "row alone differs"))
    i_ = s.intermediate  # a row carries both operands: [gate | up]
    add(_rows_probe("swiglu", lambda a: ops.swiglu(a[:, :i_], a[:, i_:]), rnd(rows, 2 * i_) * 4, gen))
    lm = rnd(s.vocab, s.hidden) * 0.05
    xt = torch.cat([rnd(rows, s.hidden), (torch.rand(rows, 1, generator=gen) + 0.3).to(dt)], 1)
    add(_rows_probe("logprobs/lm-head-log-softmax",  # a row carries [hidden | temperature]
                    lambda a: ops.logprobs(a[:, :-1], lm, a[:, -1].float().abs() + 0.3), xt, gen))
    add(_lm_head_grad_probe(ops, s, dt, gen))
    e = max(2, s.num_experts)
    add(_rows_probe("moe/route", lambda a: ops.moe_route(a, min(s.top_k, e), True).weights,
                    torch.randn(rows, e, generator=gen), gen))
    add(_rows_probe("moe/route-ids", lambda a: ops.moe_route(a, min(s.top_k, e), True).experts,
                    torch.randn(rows, e, generator=gen).round(), gen))
    add(_attention_probe(ops, s, dt, gen))
    add(_head_slice_probe(ops, s, dt, gen))
    add(_sampling_probe(s, gen))
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


def certificate_path(config: KernelConfig) -> Path:
    """Keyed by the fingerprint, the machine, torch and (reference backend) the native build."""
    m = machine_info()
    parts = [m["processor"], m["cpu_capability"], m["torch"]]
    if config.backend == "reference":
        parts.append(cpu.library_path().name)
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:10]
    return onpolicy_home() / "certificates" / f"{config.fingerprint}-{key}.json"


def save_certificate(report: SelftestReport, config: KernelConfig) -> Path:
    """Atomically write the report where ``is_certified`` finds it."""
    path = certificate_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(report.to_dict(), indent=1))
    os.replace(tmp, path)
    return path


def is_certified(config: KernelConfig) -> bool:
    path = certificate_path(config)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("certified") is True
