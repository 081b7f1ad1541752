"""Our operators inside vLLM: the glue that makes a vllm-ascend model compute with the onpolicy
operator set, so that its logprobs can equal the trainer's bit for bit.

``OnpolicyWorkerExtension`` is mixed into vLLM's worker class (``LLM(worker_extension_cls=...)``)
and called through ``collective_rpc``; ``onpolicy_install`` runs after the worker has loaded the
model and vllm-ascend has applied its own batch-invariant overrides, so ours are the last
registrations:

* ``aten::mm`` / ``addmm`` / ``linear`` / ``matmul`` (2-D right operand) on the NPU dispatch key ->
  ``Backend.linear`` (rows padded to the row tile, ``torch.ops.onpolicy.matmul``);
* every attention layer's ``impl.forward`` -> :func:`vllm_paged_attention`: K/V written into vLLM's
  paged cache, then ``Backend.attention`` over a ``PagedKV`` view of that same cache — vLLM's
  metadata (``query_start_loc``, ``seq_lens``, block table) becomes our ``AttentionBatch``, so the
  call is the one our own rollout engine makes (``torch.ops.onpolicy.paged_attention``);
* RMSNorm (with vLLM's fused residual add), SiluAndMul, RoPE (neox style, our fp32 table) and the
  LM head (fp32 logits) -> the backend methods our model code calls;
* ``aten::_log_softmax`` / ``aten::log_softmax.int`` -> ``torch.ops.onpolicy.log_softmax`` at
  temperature 1 (vLLM has already divided the fp32 logits by the temperature).

Everything but ``OnpolicyWorkerExtension`` and :func:`install` is plain torch on our ``Backend``
interface and is tested on CPU with the reference backend (``tests/external_engine``). Nothing here
imports vllm, vllm_ascend or torch_npu at module import. Unverified on hardware: see docs/ascend.md.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from onpolicy.kernels import AttentionBatch, Backend, KernelConfig, PagedKV

log = logging.getLogger(__name__)

#: Dispatch key of Ascend NPUs in ``torch.library`` (the key vllm-ascend registers its overrides on).
NPU_DISPATCH_KEY = "NPU"
#: vLLM's padding slot in ``slot_mapping`` (token rows that must not be written to the cache).
PAD_SLOT_ID = -1
#: Kept alive for the process lifetime: dropping a ``torch.library.Library`` removes its kernels.
_ATEN_LIBS: list[Any] = []


# -- attention ---------------------------------------------------------------------------------


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store token rows ``key``/``value`` ``[T, Hkv, D]`` in the paged caches ``[P, page, Hkv, D]``
    at flat slots ``page * page_size + offset`` (padding slots skipped); plain indexed copies."""
    slots = slot_mapping.to(torch.int64)
    keep = slots != PAD_SLOT_ID
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    heads, dim = key_cache.shape[-2:]
    key_cache.view(-1, heads, dim).index_copy_(0, slots, key.reshape(-1, heads, dim).to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, value.reshape(-1, heads, dim).to(value_cache.dtype))


def attention_batch(query_start_loc: Sequence[int], seq_lens: Sequence[int], device: torch.device | str,
                    ) -> tuple[AttentionBatch, list[int]]:
    """vLLM's per-request ``query_start_loc`` (``[S + 1]``) and ``seq_lens`` (K/V positions incl.
    the new tokens) as our ``AttentionBatch``; requests without query rows (padding) are left out.
    Returns the batch and the indices of the requests it holds (rows of the block table)."""
    starts = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    if len(starts) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} sequences (expected S + 1)")
    kept = [s for s in range(len(lens)) if starts[s + 1] > starts[s]]
    if not kept:
        raise ValueError("no sequence has query rows")
    if starts[kept[0]] != 0 or any(starts[a + 1] != starts[b] for a, b in itertools.pairwise(kept)):
        raise ValueError("query rows of the kept sequences must be packed from row 0")
    q_lens = [starts[s + 1] - starts[s] for s in kept]
    kv_lens = [lens[s] for s in kept]
    q_starts = [kv - q for kv, q in zip(kv_lens, q_lens, strict=True)]
    return AttentionBatch.build(q_lens, q_starts, kv_lens, device=device), kept


def vllm_paged_attention(backend: Backend, query: Tensor, key: Tensor | None, value: Tensor | None, key_cache: Tensor,
                         value_cache: Tensor, slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                         block_table: Tensor, scale: float, num_tokens: int) -> Tensor:
    """One vLLM attention call on our operators: write the new K/V rows into vLLM's cache, then
    attend over it with ``backend.attention``. ``query`` ``[>= num_tokens, Hq, D]`` (rows packed per
    request as ``query_start_loc`` says), ``key``/``value`` ``[>= num_tokens, Hkv, D]``, caches
    ``[P, page, Hkv, D]``, ``block_table`` ``[S, max_pages]``; returns ``[num_tokens, Hq, D]``. With
    ``key``/``value`` None (a vLLM that stores K/V in a separate op) the cache is only read."""
    n = num_tokens
    if key is not None and value is not None:
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping[:n])
    batch, kept = attention_batch(query_start_loc.tolist(), seq_lens.tolist(), query.device)
    if batch.num_rows != n:
        raise ValueError(f"query_start_loc covers {batch.num_rows} rows, the call has {n}")
    table = block_table[torch.tensor(kept, device=block_table.device)].to(torch.int64)
    return backend.attention(query[:n], PagedKV(key_cache, value_cache, table), batch, scale)


def _attention_forward(backend: Backend, impl: Any, layer: Any, query: Tensor, key: Tensor, value: Tensor,
                       kv_cache: Any, attn_metadata: Any, output: Tensor | None = None, *args: Any,
                       **kwargs: Any) -> Tensor:
    """Replacement of a vLLM attention impl's ``forward`` (same call signature)."""
    heads, kv_heads, dim = impl.num_heads, impl.num_kv_heads, impl.head_size
    q = query.reshape(-1, heads, dim)
    if output is None:
        output = torch.zeros(q.shape[0], heads * dim, dtype=query.dtype, device=query.device)
    if attn_metadata is None:  # vLLM's profiling run: no cache, no metadata
        return output.zero_()
    n = int(attn_metadata.num_actual_tokens)
    table = getattr(attn_metadata, "block_tables", None)
    if table is None:
        table = attn_metadata.block_table
    k = None if key is None else key.reshape(-1, kv_heads, dim)
    v = None if value is None else value.reshape(-1, kv_heads, dim)
    out = vllm_paged_attention(backend, q, k, v, kv_cache[0], kv_cache[1], attn_metadata.slot_mapping,
                               attn_metadata.query_start_loc, attn_metadata.seq_lens, table, float(impl.scale), n)
    output.view(-1, heads * dim)[:n] = out.reshape(n, heads * dim).to(output.dtype)
    return output


# -- row-wise layers ---------------------------------------------------------------------------


def rms_norm_forward(backend: Backend, weight: Tensor, eps: float, x: Tensor,
                     residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """vLLM's ``RMSNorm.forward``: with ``residual``, add it first (in the model dtype, as our
    decoder's ``x + h``) and return ``(normed, new_residual)``."""
    if residual is not None:
        x = x + residual
        residual = x
    out = backend.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).reshape(x.shape)
    return out if residual is None else (out, residual)


def silu_and_mul_forward(backend: Backend, x: Tensor) -> Tensor:
    """vLLM's ``SiluAndMul``: ``x = [gate | up]`` from the merged gate/up projection."""
    d = x.shape[-1] // 2
    return backend.swiglu(x[..., :d], x[..., d:])


def rope_forward(backend: Backend, cos_table: Tensor, sin_table: Tensor, head_size: int, positions: Tensor,
                 query: Tensor, key: Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """vLLM's ``RotaryEmbedding.forward`` (neox style, full rotary dim) on our one fp32 table."""
    pos = positions.reshape(-1).to(torch.int64)
    cos, sin = cos_table[pos], sin_table[pos]

    def rotate(x: Tensor) -> Tensor:
        return backend.rope(x.reshape(pos.shape[0], -1, head_size), cos, sin).reshape(x.shape)

    return rotate(query), None if key is None else rotate(key)


def lm_head_logits(backend: Backend, hidden: Tensor, weight: Tensor) -> Tensor:
    """fp32 logits as our ``Backend.logprobs`` computes them (fp32 operands, the batch-invariant matmul)."""
    return backend.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.float())


# -- matmul family (aten overrides) --------------------------------------------------------------


def matmul_overrides(backend: Backend) -> dict[str, Any]:
    """``aten`` overload name -> implementation on ``backend.linear`` (each row's dot products in
    the operator set's one fixed order, whatever the number of rows)."""

    def rows(x: Tensor, w_t: Tensor) -> Tensor:  # x [..., K] @ w_t.T, w_t [N, K]
        y = backend.linear(x.reshape(-1, x.shape[-1]), w_t)
        return y.reshape(*x.shape[:-1], w_t.shape[0])

    def mm(a: Tensor, b: Tensor) -> Tensor:
        return rows(a, b.t())

    def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1, alpha: float = 1) -> Tensor:
        if beta != 1 or alpha != 1:
            raise NotImplementedError("onpolicy addmm override supports beta = alpha = 1 only")
        return bias + rows(a, b.t())

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        y = rows(x, weight)
        return y if bias is None else y + bias

    def matmul(a: Tensor, b: Tensor) -> Tensor:
        if b.dim() != 2 or a.dim() < 2:
            raise NotImplementedError("onpolicy matmul override: the right operand must be a 2-D matrix")
        return rows(a, b.t())

    return {"mm": mm, "addmm": addmm, "linear": linear, "matmul": matmul}


def register_aten_overrides(backend: Backend, dispatch_key: str = NPU_DISPATCH_KEY) -> list[str]:
    """Register :func:`matmul_overrides` and the log-softmax kernel for ``dispatch_key``; returns the
    overload names (later registrations of the same ops win, so call after vllm-ascend's)."""
    lib = torch.library.Library("aten", "IMPL")
    impls = matmul_overrides(backend)
    ops = torch.ops.onpolicy

    def log_softmax(x: Tensor, dim: int, *rest: Any) -> Tensor:
        if dim not in (-1, x.dim() - 1):
            raise NotImplementedError("onpolicy log_softmax override: last dimension only")
        xf = x.float().reshape(-1, x.shape[-1]).contiguous()
        ones = torch.ones(xf.shape[0], dtype=torch.float32, device=x.device)
        return ops.log_softmax(xf, ones).reshape(x.shape)

    impls = {**impls, "_log_softmax": log_softmax, "log_softmax.int": log_softmax}
    for name, fn in impls.items():
        lib.impl(name, fn, dispatch_key)
    _ATEN_LIBS.append(lib)
    return sorted(impls)


# -- installing into a loaded vLLM model -----------------------------------------------------------


def _class_names(module: Any) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


class _Fp32LmHead:
    """Wraps the LM head's quant method: logits in fp32 on our matmul; everything else delegated."""

    def __init__(self, inner: Any, backend: Backend) -> None:
        self._inner, self._backend = inner, backend

    def apply(self, layer: Any, x: Tensor, bias: Tensor | None = None) -> Tensor:
        logits = lm_head_logits(self._backend, x, layer.weight)
        return logits if bias is None else logits + bias.float()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install(model: Any, backend: Backend) -> dict[str, int]:
    """Route a loaded vLLM model's computation through ``backend``; returns what was replaced.

    Refuses (``NotImplementedError``) a RoPE variant our table does not reproduce (rope scaling,
    partial rotary dim, GPT-J style): running it on vLLM's kernels would break the bitwise contract.
    """
    from onpolicy.models.causal_lm import rope_table

    counts = {"attention": 0, "rms_norm": 0, "silu_and_mul": 0, "rope": 0, "lm_head": 0}
    counts["aten_overrides"] = len(register_aten_overrides(backend))
    for module in model.modules():
        names = _class_names(module)
        if "Attention" in names and hasattr(module, "impl"):
            impl = module.impl
            impl.forward = functools.partial(_attention_forward, backend, impl)
            counts["attention"] += 1
        elif "RMSNorm" in names:
            module.forward = functools.partial(rms_norm_forward, backend, module.weight, float(module.variance_epsilon))
            counts["rms_norm"] += 1
        elif "SiluAndMul" in names:
            module.forward = functools.partial(silu_and_mul_forward, backend)
            counts["silu_and_mul"] += 1
        elif "RotaryEmbedding" in names:
            plain = type(module).__name__ in ("RotaryEmbedding", "AscendRotaryEmbedding")
            if not (plain and module.is_neox_style and module.rotary_dim == module.head_size):
                raise NotImplementedError(f"{type(module).__name__} (rotary_dim {module.rotary_dim}, neox "
                                          f"{module.is_neox_style}) is not reproduced by the onpolicy RoPE table")
            cos, sin = rope_table(module.head_size, float(module.base), int(module.max_position_embeddings))
            device = next((b.device for b in module.buffers()), torch.device("cpu"))
            module.forward = functools.partial(rope_forward, backend, cos.to(device), sin.to(device), module.head_size)
            counts["rope"] += 1
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "quant_method"):
        head.quant_method = _Fp32LmHead(head.quant_method, backend)
        counts["lm_head"] = 1
    return counts


def _worker_model(worker: Any) -> Any:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


class OnpolicyWorkerExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), called via ``collective_rpc``."""

    def onpolicy_install(self, backend: str, compute_dtype: str, kv_tile: int) -> dict[str, Any]:
        """Install our operators in this worker's model; report what was done and whether vLLM's
        batch-invariant mode is on."""
        from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant

        from onpolicy.kernels import get_backend

        ops = get_backend(KernelConfig(backend=backend, compute_dtype=compute_dtype, kv_tile=kv_tile))  # type: ignore[arg-type]
        provider = str(getattr(ops, "provider", ""))
        if provider != "onpolicy":
            raise RuntimeError(f"the vllm-ascend engine runs the onpolicy Ascend operators (torch.ops.onpolicy); "
                               f"backend {backend!r} has provider {provider!r}")
        counts = install(_worker_model(self), ops)
        return {**counts, "batch_invariant": bool(vllm_is_batch_invariant()), "fingerprint": ops.fingerprint}

    def onpolicy_load_weights(self, weights: list[tuple[str, Tensor]]) -> int:
        """Load HF-named tensors (a verified weight version) into this worker's model."""
        loaded = _worker_model(self).load_weights(weights=iter(weights))
        return len(loaded) if loaded is not None else len(weights)
