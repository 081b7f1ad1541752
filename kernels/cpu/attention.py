"""The consistent attention on CPU: ``attention.c``'s tile routine, reached from a ``KVSource``.

Every query row reads the K/V rows of its own sequence at positions ``0..p`` through one index
``[S, Hkv, L]`` into the storage rows of the source (a paged cache or a training forward's packed
K/V), so no dense copy of the keys and values is made and a row's arithmetic never depends on the
batch (``attention.c`` states the order). Under autograd the forward is the same kernel and the
backward is the analytic softmax-attention gradient in one native call (``attention_backward.c``;
gradients carry no bitwise contract, it is deterministic).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv import AttentionBatch, KVSource, head_slots, layout_key
from . import _operand_dtype_ok, library


def exp(x: Tensor, *, portable: bool = False) -> Tensor:
    """The kernel's ``exp_`` on a fp32 tensor (for tests: both paths, accuracy against ``torch.exp``)."""
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty_like(x)
    library().native_exp(x.data_ptr(), y.data_ptr(), x.numel(), int(portable))
    return y


def _kv_rows(t: Tensor, name: str) -> Tensor:
    """``t`` as ``[rows, D]`` storage rows, read in place when its last dim is contiguous."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.dtype == torch.float16:
        rows = rows.float()
    if not _operand_dtype_ok(rows):
        raise ValueError(f"attention: {name} must be fp32, bf16 or fp16 on CPU, got {rows.dtype} on {rows.device}")
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_rows(idx: Tensor, seq: Tensor, pos: Tensor, storage_rows: int) -> None:
    """Every index the kernel will follow is in range (it reads memory through them unchecked)."""
    s, _, length = idx.shape
    if int(seq.min()) < 0 or int(seq.max()) >= s or int(pos.min()) < 0 or int(pos.max()) >= length:
        raise ValueError(f"attention: a row's sequence or position is outside the index [{s}, *, {length}]")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= storage_rows):
        raise ValueError(f"attention: the K/V source names rows outside its {storage_rows} storage rows")


def _require_index(*ts: Tensor) -> None:
    """A checked index must still be what the kernel reads: int64 and contiguous."""
    if not all(t.dtype == torch.int64 and t.is_contiguous() for t in ts):
        raise ValueError("attention: a checked index must be int64 and contiguous (idx, seq, pos)")


def attention_rows(q: Tensor, k_rows: Tensor, v_rows: Tensor, idx: Tensor, seq: Tensor, pos: Tensor, scale: float,
                   kv_tile: int, *, portable: bool = False, threads: int | None = None, checked: bool = False,
                   ) -> Tensor:
    """fp32 ``[N, Hq, D]``: query row ``n`` (of sequence ``seq[n]`` at position ``pos[n]``) attends over
    storage rows ``idx[seq[n], h // (Hq / Hkv), 0..pos[n]]`` of ``k_rows``/``v_rows [R, D]``. Every
    index is range-checked unless ``checked`` (the caller did it, once per batch, and passes int64
    contiguous ``idx``/``seq``/``pos``); ``portable`` runs
    the portable path, ``threads`` defaults to torch's."""
    n, hq, d = q.shape
    _, hkv, length = idx.shape
    if q.dtype == torch.float16:
        q = q.float()
    if not _operand_dtype_ok(q) or q.stride(-1) != 1:
        q = q.float().contiguous()
    if k_rows.dtype != v_rows.dtype:  # widen both (exact) rather than round one
        k_rows, v_rows = k_rows.float(), v_rows.float()
    if v_rows.stride(0) != k_rows.stride(0):
        k_rows, v_rows = k_rows.contiguous(), v_rows.contiguous()
    if (hq % hkv or k_rows.shape != v_rows.shape or k_rows.shape[1] != d or kv_tile < 1
            or seq.shape != (n,) or pos.shape != (n,)):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k_rows.shape)}, v {tuple(v_rows.shape)}, "
                         f"{hkv} KV heads, {n} rows of seq/pos and kv_tile {kv_tile} do not fit together")
    if not (q.is_cpu and k_rows.is_cpu and v_rows.is_cpu and idx.is_cpu and seq.is_cpu and pos.is_cpu):
        raise ValueError("attention: the native kernel runs on CPU tensors")
    if not checked:
        idx, seq, pos = (t.to(torch.int64).contiguous() for t in (idx, seq, pos))
        if n:
            _check_rows(idx, seq, pos, k_rows.shape[0])
    else:
        _require_index(idx, seq, pos)
    out = torch.empty(n, hq, d, dtype=torch.float32)
    if n:
        rc = library().attention_rows(
            q.data_ptr(), int(q.dtype == torch.bfloat16), q.stride(0), q.stride(1), k_rows.data_ptr(),
            v_rows.data_ptr(), int(k_rows.dtype == torch.bfloat16), k_rows.stride(0), idx.data_ptr(), length,
            seq.data_ptr(), pos.data_ptr(), n, hq, hkv, d, kv_tile, scale, out.data_ptr(),
            threads or torch.get_num_threads(), int(portable))
        if rc != 0:
            raise MemoryError("attention: the kernel's scratch memory could not be allocated")
    return out


def attention_backward(q: Tensor, k_rows: Tensor, v_rows: Tensor, idx: Tensor, seq: Tensor, pos: Tensor,
                       out: Tensor, grad: Tensor, scale: float, *, threads: int | None = None,
                       checked: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The gradient of :func:`attention_rows` (``out`` its output, ``grad`` the output's gradient):
    fp32 ``(dq [N, Hq, D], dk, dv [R, D])`` in one native call (``attention_backward.c``: one task per
    sequence and query head, deterministic). ``idx``/``seq``/``pos`` must be int64 and contiguous;
    their ranges are checked unless ``checked`` (the forward's, already checked)."""
    n, hq, d = q.shape
    s, hkv, length = idx.shape
    if (grad.shape != q.shape or out.shape != q.shape or k_rows.shape != v_rows.shape or k_rows.shape[-1] != d
            or hq % hkv or seq.shape != (n,) or pos.shape != (n,)):
        raise ValueError(f"attention backward: q {tuple(q.shape)}, grad {tuple(grad.shape)}, out {tuple(out.shape)}, "
                         f"k {tuple(k_rows.shape)}, v {tuple(v_rows.shape)} and {hkv} KV heads do not fit together")
    _require_index(idx, seq, pos)
    if n and not checked:
        _check_rows(idx, seq, pos, k_rows.shape[0])
    qf, gf, of = (t.detach().float().contiguous() for t in (q, grad, out))
    kf, vf = (t.detach().float().contiguous() for t in (k_rows, v_rows))
    order = torch.argsort(seq, stable=True)
    starts = torch.zeros(s + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(seq, minlength=s), 0, out=starts[1:])
    lens = torch.zeros(s, dtype=torch.int64).scatter_reduce_(0, seq, pos + 1, "amax")
    dq = torch.empty(n, hq, d, dtype=torch.float32)
    dk_heads = torch.empty(s, hq, length, d, dtype=torch.float32)
    dv_heads = torch.empty(s, hq, length, d, dtype=torch.float32)
    if n and d:
        rc = library().attention_backward_rows(
            qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(), of.data_ptr(), idx.data_ptr(), length,
            pos.data_ptr(), order.data_ptr(), starts.data_ptr(), lens.data_ptr(), s, hq, hkv, d, scale,
            dq.data_ptr(), dk_heads.data_ptr(), dv_heads.data_ptr(), threads or torch.get_num_threads())
        if rc != 0:
            raise MemoryError("attention backward: the kernel's scratch memory could not be allocated")
    # the positions each sequence read, summed over the query heads of each KV head, into the rows
    read = (torch.arange(length)[None, :] < lens[:, None])[:, None, :].expand(s, hkv, length)
    rows = idx[read]
    dk, dv = torch.zeros(kf.shape, dtype=torch.float32), torch.zeros(vf.shape, dtype=torch.float32)
    for heads, grads in ((dk_heads, dk), (dv_heads, dv)):
        per_kv = heads.view(s, hkv, hq // hkv, length, d).sum(2)
        grads.index_add_(0, rows, per_kv[read])
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Forward: :func:`attention_rows`. Backward: :func:`attention_backward`."""

    @staticmethod
    def forward(ctx, q: Tensor, k_rows: Tensor, v_rows: Tensor, idx: Tensor, seq: Tensor, pos: Tensor,  # type: ignore[override]
                scale: float, kv_tile: int) -> Tensor:
        out = attention_rows(q, k_rows, v_rows, idx, seq, pos, scale, kv_tile, checked=True)
        ctx.save_for_backward(q, k_rows, v_rows, idx, seq, pos, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k_rows, v_rows, idx, seq, pos, out = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k_rows, v_rows, idx, seq, pos, out, grad, ctx.scale, checked=True)
        need = ctx.needs_input_grad
        return (dq.to(q.dtype) if need[0] else None, dk.to(k_rows.dtype) if need[1] else None,
                dv.to(v_rows.dtype) if need[2] else None, None, None, None, None, None)


def _row_layout(batch: AttentionBatch) -> tuple[Tensor, Tensor]:
    """Each packed query row's sequence and position ``[N]``."""
    valid = batch.q_index >= 0
    seq = torch.empty(batch.num_rows, dtype=torch.int64, device=batch.q_index.device)
    pos = torch.empty_like(seq)
    rows = batch.q_index[valid]
    seq[rows] = torch.arange(batch.num_seqs, device=seq.device)[:, None].expand_as(batch.q_index)[valid]
    pos[rows] = batch.q_pos[valid]
    return seq, pos


def _index(kv: KVSource, batch: AttentionBatch, hkv: int, storage_rows: int, seq: Tensor, pos: Tensor) -> Tensor:
    """The ``[S, Hkv, L]`` storage rows of every (sequence, KV head, position), range-checked once."""
    idx = head_slots(kv.slots(batch.max_kv_len), hkv).to(torch.int64).contiguous()
    if idx.shape[0] != batch.num_seqs:
        raise ValueError(f"attention: the K/V source has {idx.shape[0]} sequences, the batch {batch.num_seqs}")
    if batch.num_rows:
        _check_rows(idx, seq, pos, storage_rows)
    return idx


def row_index(kv: KVSource, batch: AttentionBatch, hkv: int, storage_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(idx, seq, pos)`` of :func:`attention_rows` for ``batch`` over ``kv`` (``storage_rows`` rows of
    head_dim), range-checked; computed once per batch and K/V layout (every layer shares them)."""
    seq, pos = batch.memo("native_rows", lambda: _row_layout(batch))
    _, idx = batch.memo(("native_index", hkv, layout_key(kv)),
                        lambda: (kv.page_table if hasattr(kv, "page_table") else kv.cu_seqlens,
                                 _index(kv, batch, hkv, storage_rows, seq, pos)))
    return idx, seq, pos


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, kv_tile: int) -> Tensor:
    """``Backend.attention`` on the native tile routine: packed ``q [N, Hq, D]`` -> ``[N, Hq, D]`` in
    ``q``'s dtype. The row layout and the K/V index are computed once per batch (every layer shares
    them)."""
    k, v = kv.flat()
    hkv = k.shape[1]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    if q.shape[0] != batch.num_rows:
        raise ValueError(f"attention: {q.shape[0]} query rows for a batch of {batch.num_rows}")
    k_rows, v_rows = _kv_rows(k, "k"), _kv_rows(v, "v")
    if k_rows.shape != v_rows.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    idx, seq, pos = row_index(kv, batch, hkv, k_rows.shape[0])
    if torch.is_grad_enabled() and (q.requires_grad or k_rows.requires_grad or v_rows.requires_grad):
        out = _Attention.apply(q, k_rows, v_rows, idx, seq, pos, scale, kv_tile)
    else:
        out = attention_rows(q, k_rows, v_rows, idx, seq, pos, scale, kv_tile, checked=True)
    return out.to(q.dtype)
