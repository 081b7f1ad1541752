"""Every dense decoder layer of a forward pass in one native call (``stack.c``): the reference
backend's ``decoder_stack``.

A decode step at batch 1 spends a large share of its time between kernels: a dozen Python-level
operator calls per layer, each checking and allocating. ``stack.c`` chains the same kernel entry
points with the same operands in C, so the residual stream it returns has the bits of the
per-operator path (the tests assert it with ``torch.equal`` through whole models). It runs without
autograd, for fp32 or bf16 models whose weights, activations and K/V cache share one dtype;
anything else (and any model it cannot describe: MoE layers, tensor parallelism) takes the
per-operator path.
"""

from __future__ import annotations

import ctypes
import functools
from array import array

import torch
from torch import Tensor

from ..backend import DenseLayer, DenseStack
from ..kv import AttentionBatch, PagedCacheWrite
from . import library, pack, packable
from .attention import row_index

_I64, _INT, _PTR, _F = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


class _Args(ctypes.Structure):
    """``stack_args`` of stack.c, field for field."""

    _fields_ = [("rows", _I64), ("hidden", _I64), ("q_heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("inter", _I64), ("layers", _I64), ("chunks", _I64), ("weights", _PTR), ("cos", _PTR),
                ("sin", _PTR), ("k_cache", _PTR), ("v_cache", _PTR), ("cache_layer", _I64), ("slots", _PTR),
                ("idx", _PTR), ("kv_len", _I64), ("seq", _PTR), ("pos", _PTR), ("x", _PTR), ("eps", _F),
                ("scale", _F), ("bf16", _INT), ("tile", _INT), ("threads", _INT), ("force_portable", _INT)]


@functools.cache
def _entry() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = library()
    lib.stack_ptrs.restype = _INT
    if lib.stack_ptrs() != len(_FIELDS) + len(_PACKED):
        raise RuntimeError(f"stack.c takes {lib.stack_ptrs()} addresses per layer, stack.py passes "
                           f"{len(_FIELDS) + len(_PACKED)}")
    fn = lib.decoder_stack
    fn.argtypes = [ctypes.POINTER(_Args)]
    fn.restype = _INT
    return fn


#: A layer's addresses in stack.c's order (W_IN_NORM .. W_DOWN); the RowWeights are read chunked.
_FIELDS = ("input_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "o", "o_bias",
           "post_norm", "gate", "up", "down")
#: Then the packed copies of these (P_Q .. P_DOWN; 0 where none).
_PACKED = ("q", "k", "v", "o", "gate", "up", "down")
#: Most rows of a step that read the packed copies (``PACKED_ROWS`` in stack.c).
PACKED_ROWS = 4


def _layer_tensors(layer: DenseLayer, chunks: int) -> list[Tensor | None]:
    return [layer.o.chunked(chunks) if f == "o" else layer.down.chunked(chunks) if f == "down"
            else getattr(layer, f) for f in _FIELDS]


def _table(stack: DenseStack, dtype: torch.dtype, chunks: int, hidden: int, packed: bool) -> array | None:
    """The layers' addresses for stack.c (None when a weight is not the kernel's), rebuilt only
    when a parameter moved or changed (its address or version; the chunked copies follow). With
    ``packed`` (a step of few rows) the packed copies are made on first use and kept with the
    table. Writes through ``.data`` change neither and are not seen (as for the chunked copies)."""
    params = stack.tensors()
    key = (dtype, chunks, hidden, *((t.data_ptr(), t._version) for t in params))
    hit = stack.cache.get("native_stack")
    if not (isinstance(hit, dict) and hit["key"] == key):
        stack.cache.pop("native_stack", None)  # the old copies go before the new ones are made
        hit = _plain_table(stack, dtype, chunks, hidden)
        if hit is None:
            return None
        hit["key"] = key
        stack.cache["native_stack"] = hit
    if packed and not hit["packed"]:
        _add_packed(hit, stack, chunks, dtype)
    return hit["table"]


def _plain_table(stack: DenseStack, dtype: torch.dtype, chunks: int, hidden: int) -> dict[str, object] | None:
    hq, hkv, d = stack.num_heads, stack.num_kv_heads, stack.head_dim
    inter = stack.layers[0].gate.shape[0]
    qd, kd = hq * d, hkv * d
    table = array("q")
    keep: list[Tensor] = []  # the chunked copies the table points into
    for layer in stack.layers:
        ts = _layer_tensors(layer, chunks)
        if not all(_usable(t, dtype) for t in ts):
            return None
        shapes = (layer.q.shape, layer.k.shape, layer.v.shape, layer.gate.shape, layer.up.shape,
                  layer.o.weight.shape, layer.down.weight.shape)
        if shapes != ((qd, hidden), (kd, hidden), (kd, hidden), (inter, hidden), (inter, hidden), (hidden, qd),
                      (hidden, inter)) or qd % chunks or inter % chunks:
            return None
        keep += [t for t in ts if t is not None]
        table.extend(0 if t is None else t.data_ptr() for t in ts)
        table.extend([0] * len(_PACKED))
    return {"table": table, "keep": keep, "packed": False}


def _add_packed(entry: dict[str, object], stack: DenseStack, chunks: int, dtype: torch.dtype) -> None:
    """Fills the table's P_* addresses with packed copies: every linear of a bf16 model (pair-packed:
    half the conversion work per weight), the row-parallel ones of an fp32 model (their chunks are
    short rows; the other fp32 weights stream as fast unpacked, measured). Nothing when a weight
    that should be packed is not packable."""
    fields = _PACKED if dtype == torch.bfloat16 else ("o", "down")
    weights = [[(getattr(layer, f).weight if f in ("o", "down") else getattr(layer, f),
                 chunks if f in ("o", "down") else 1) for f in fields] for layer in stack.layers]
    entry["packed"] = True  # tried: not again for these weights
    if not all(packable(w, c) for layer in weights for w, c in layer):
        return
    table, width = entry["table"], len(_FIELDS) + len(_PACKED)
    assert isinstance(table, array)
    for i, layer in enumerate(weights):
        for f, (w, c) in zip(fields, layer, strict=True):
            copy = pack(w, c)
            table[i * width + len(_FIELDS) + _PACKED.index(f)] = copy.data_ptr()
            entry["keep"].append(copy)  # type: ignore[attr-defined]


def _usable(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_cpu and t.is_contiguous())


def decoder_stack(x: Tensor, stack: DenseStack, cos: Tensor, sin: Tensor, cache: PagedCacheWrite,
                  batch: AttentionBatch, *, kv_tile: int, chunks: int, portable: bool = False,
                  threads: int | None = None) -> Tensor | None:
    """``Backend.decoder_stack`` on ``stack.c``: the residual stream ``[N, H]`` after every layer of
    ``stack``, or None when autograd is on or the operands are not the kernel's (then nothing was
    computed or written)."""
    dtype = x.dtype
    if (dtype not in (torch.float32, torch.bfloat16) or torch.is_grad_enabled()
            or x.dim() != 2 or not x.is_cpu or cache.k.dtype != dtype or cache.v.dtype != dtype
            or not (cache.k.is_contiguous() and cache.v.is_contiguous()) or cache.k.shape != cache.v.shape):
        return None
    n, hidden = x.shape
    hq, hkv, d = stack.num_heads, stack.num_kv_heads, stack.head_dim
    if cache.k.shape[-2:] != (hkv, d) or hq % hkv or not stack.layers or cache.k.shape[0] < len(stack.layers):
        return None
    if batch.num_rows != n:
        raise ValueError(f"decoder_stack: {n} rows of x for a batch of {batch.num_rows}")
    table = _table(stack, dtype, chunks, hidden, packed=n <= PACKED_ROWS and not portable)
    if table is None:
        return None
    if n == 0:
        return x
    storage_rows = cache.k[0].numel() // d
    idx, seq, pos = row_index(cache.layer(0), batch, hkv, storage_rows)
    slots = cache.slots.to(torch.int64).contiguous()
    if slots.shape != (n,) or int(slots.min()) < 0 or int(slots.max()) * hkv >= storage_rows:
        raise ValueError(f"decoder_stack: {n} rows need {n} cache slots in range, got {tuple(slots.shape)}")
    c, s = cos.float().contiguous(), sin.float().contiguous()
    if c.shape != (n, d) or s.shape != (n, d):
        raise ValueError(f"decoder_stack: cos/sin must be [{n}, {d}], got {tuple(c.shape)} and {tuple(s.shape)}")
    out = x.contiguous().clone()
    inter = stack.layers[0].gate.shape[0]
    args = _Args(n, hidden, hq, hkv, d, inter, len(stack.layers), chunks, table.buffer_info()[0], c.data_ptr(),
                 s.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(0), slots.data_ptr(),
                 idx.data_ptr(), idx.shape[2], seq.data_ptr(), pos.data_ptr(), out.data_ptr(), stack.eps,
                 stack.scale, int(dtype == torch.bfloat16), kv_tile, threads or torch.get_num_threads(),
                 int(portable))
    rc = _entry()(ctypes.byref(args))
    if rc == -1:
        raise MemoryError("decoder_stack: the kernel could not allocate its scratch memory")
    if rc != 0:
        raise RuntimeError(f"decoder_stack: a kernel refused its operands (code {rc})")
    return out
