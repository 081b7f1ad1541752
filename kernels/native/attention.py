"""The consistent attention on CPU: ``attention.c``'s tile routine, reached from a ``KVSource``.

Every query row reads the K/V rows of its own sequence at positions ``0..p`` through one index
``[S, Hkv, L]`` into the storage rows of the source (a paged cache or a training forward's packed
K/V), so no dense copy of the keys and values is made and a row's arithmetic never depends on the
batch (``attention.c`` states the order). Under autograd the forward is the same kernel and the
backward is the analytic softmax-attention gradient in fp32 torch ops, per sequence (gradients
carry no bitwise contract).
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


def attention_rows(q: Tensor, k_rows: Tensor, v_rows: Tensor, idx: Tensor, seq: Tensor, pos: Tensor, scale: float,
                   kv_tile: int, *, portable: bool = False, threads: int | None = None, checked: bool = False,
                   ) -> Tensor:
    """fp32 ``[N, Hq, D]``: query row ``n`` (of sequence ``seq[n]`` at position ``pos[n]``) attends over
    storage rows ``idx[seq[n], h // (Hq / Hkv), 0..pos[n]]`` of ``k_rows``/``v_rows [R, D]``. Every
    index is range-checked unless ``checked`` (the caller did it, once per batch); ``portable`` runs
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
    if any(t.device.type != "cpu" for t in (q, k_rows, v_rows, idx, seq, pos)):
        raise ValueError("attention: the native kernel runs on CPU tensors")
    idx, seq, pos = (t.to(torch.int64).contiguous() for t in (idx, seq, pos))
    if not checked and n:
        _check_rows(idx, seq, pos, k_rows.shape[0])
    out = torch.empty((n, hq, d), dtype=torch.float32)
    if n:
        rc = library().attention_rows(
            q.data_ptr(), int(q.dtype == torch.bfloat16), q.stride(0), q.stride(1), k_rows.data_ptr(),
            v_rows.data_ptr(), int(k_rows.dtype == torch.bfloat16), k_rows.stride(0), idx.data_ptr(), length,
            seq.data_ptr(), pos.data_ptr(), n, hq, hkv, d, kv_tile, scale, out.data_ptr(),
            threads or torch.get_num_threads(), int(portable))
        if rc != 0:
            raise MemoryError("attention: the kernel's scratch memory could not be allocated")
    return out


class _Attention(torch.autograd.Function):
    """Forward: :func:`attention_rows`. Backward: per sequence, recompute the fp32 softmax with torch
    ops and apply the standard attention gradient; K/V gradients are scattered back to the rows."""

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
        hq, d = q.shape[1], q.shape[2]
        hkv = idx.shape[1]
        g = hq // hkv
        grad = grad.float()
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dk = torch.zeros(k_rows.shape, dtype=torch.float32)
        dv = torch.zeros(v_rows.shape, dtype=torch.float32)
        delta = (grad * out).sum(-1)  # [N, Hq]
        order = torch.argsort(seq, stable=True)
        counts = torch.bincount(seq, minlength=idx.shape[0]).tolist()
        for s, rows in enumerate(order.split(counts)):
            if not rows.numel():
                continue
            p = pos[rows]
            length = int(p.max()) + 1
            kid = idx[s, :, :length].reshape(-1)
            ks = k_rows.index_select(0, kid).float().view(hkv, 1, length, d).expand(hkv, g, length, d)
            vs = v_rows.index_select(0, kid).float().view(hkv, 1, length, d).expand(hkv, g, length, d)
            ks, vs = ks.reshape(hq, length, d), vs.reshape(hq, length, d)
            qs = q[rows].float().transpose(0, 1)  # [Hq, n, D]
            gs = grad[rows].transpose(0, 1)
            scores = torch.matmul(qs, ks.transpose(1, 2)) * ctx.scale
            scores.masked_fill_(torch.arange(length) > p[:, None], float("-inf"))
            prob = torch.softmax(scores, dim=-1)  # [Hq, n, L]
            dprob = torch.matmul(gs, vs.transpose(1, 2))
            dscore = prob * (dprob - delta[rows].t()[..., None]) * ctx.scale
            dq[rows] = torch.matmul(dscore, ks).transpose(0, 1)
            dk.index_add_(0, kid, torch.matmul(dscore.transpose(1, 2), qs).view(hkv, g, length, d).sum(1).view(-1, d))
            dv.index_add_(0, kid, torch.matmul(prob.transpose(1, 2), gs).view(hkv, g, length, d).sum(1).view(-1, d))
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
    idx = head_slots(kv.slots(batch.max_kv_len), hkv).contiguous()
    if idx.shape[0] != batch.num_seqs:
        raise ValueError(f"attention: the K/V source has {idx.shape[0]} sequences, the batch {batch.num_seqs}")
    if batch.num_rows:
        _check_rows(idx, seq, pos, storage_rows)
    return idx


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
    seq, pos = batch.memo("native_rows", lambda: _row_layout(batch))
    _, idx = batch.memo(("native_index", hkv, layout_key(kv)),
                        lambda: (kv.page_table if hasattr(kv, "page_table") else kv.cu_seqlens,
                                 _index(kv, batch, hkv, k_rows.shape[0], seq, pos)))
    if torch.is_grad_enabled() and (q.requires_grad or k_rows.requires_grad or v_rows.requires_grad):
        out = _Attention.apply(q, k_rows, v_rows, idx, seq, pos, scale, kv_tile)
    else:
        out = attention_rows(q, k_rows, v_rows, idx, seq, pos, scale, kv_tile, checked=True)
    return out.to(q.dtype)
