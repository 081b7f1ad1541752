"""``CausalLM``: one model code path for Llama, Qwen2, Qwen3 and Qwen3-MoE, parameterised by the backend.

Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj.weight`` …) so HF and GGUF
checkpoints load without renaming. ``hidden`` runs the decoder over packed token rows under an
attention context (training or paged); ``logprobs`` applies the fp32 LM head and log-softmax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from onpolicy.kernels import Backend
from onpolicy.kernels.backend import DenseStack, ModelParallel
from onpolicy.kernels.truncation import RowTruncation

from .config import ModelConfig, RopeScaling
from .context import AttentionContext
from .layers import DecoderLayer, Linear, RMSNorm, dense_stack


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """fp32 inverse frequencies ``[head_dim / 2]``, as transformers' ``ROPE_INIT_FUNCTIONS`` compute
    them for ``scaling.rope_type`` (default, linear, llama3)."""
    cpu = torch.device("cpu")  # explicit, so a model built under a meta-device context gets a real table
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None,
               ) -> tuple[Tensor, Tensor]:
    """fp32 ``cos``/``sin`` ``[max_positions, head_dim]``, HF's RoPE (``cat(freqs, freqs)``); the
    frequencies scaled by ``scaling`` (linear, llama3: cos/sin themselves are not rescaled)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def resolve_tied_head(cfg: ModelConfig, tensors: Mapping[str, Tensor]) -> ModelConfig:
    """``cfg`` as transformers loads a checkpoint of it: ``tie_word_embeddings`` stays on when the
    checkpoint has no ``lm_head.weight`` or one equal to ``model.embed_tokens.weight``; a different
    ``lm_head.weight`` is kept as its own LM head (transformers then does not tie either)."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        return replace(cfg, tie_word_embeddings=False)
    return cfg


def check_reduce_chunks(cfg: ModelConfig, reduce_chunks: int) -> None:
    """``ValueError`` unless the canonical row reduction's ``reduce_chunks`` divides the input dims of
    ``o_proj`` and ``down_proj`` (the attention width, the intermediate size)."""
    for name, size in (("intermediate_size", cfg.intermediate_size), ("attention width", cfg.num_heads * cfg.head_dim)):
        if size and size % reduce_chunks:
            raise ValueError(f"reduce_chunks={reduce_chunks} must divide the {name} {size}")


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Backend) -> None:
        super().__init__()
        check_reduce_chunks(cfg, ops.config.reduce_chunks)
        self.config = cfg
        self.ops = ops
        self.parallel = ModelParallel()
        """The groups the layers reduce over: unsharded here, set by ``onpolicy.parallel.parallelize``."""
        self.model = Decoder(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        # The one RoPE table of this model, shared by every path (not a buffer: stays fp32 under .to()).
        self.rope_cos, self.rope_sin = rope_table(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                                   cfg.rope_scaling)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds (all of them unless the model is tensor-parallel)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def to_device(self, device: torch.device | str) -> CausalLM:
        self.to(device)
        self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)
        return self

    def hidden(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, ops: Backend | None = None,
               stack: DenseStack | None = None) -> Tensor:
        """Final-normed hidden states ``[N, H]`` of packed token rows at absolute ``positions``. With a
        ``stack`` (:meth:`dense_stack`, which an engine takes once at load time), a context that writes
        a paged cache and autograd off, every layer runs in one ``Backend.decoder_stack`` call, with
        the bits of the layers run one by one (which happens otherwise, and where the backend has no
        such call)."""
        ops = ops or self.ops
        if positions.numel() and int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.model.embed_tokens(input_ids)
        cache = getattr(ctx, "cache_write", None)
        stacked = (ops.decoder_stack(x, stack, cos, sin, cache, ctx.batch)
                   if stack is not None and cache is not None and not torch.is_grad_enabled() else None)
        if stacked is not None:
            x = stacked
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, ctx, ops)
        return self.model.norm(x, ops)

    def dense_stack(self) -> DenseStack | None:
        """The decoder layers as the operands of ``Backend.decoder_stack`` (their parameters, by
        reference: updates in place, e.g. a weight sync, are seen), or None when a layer is not the
        dense pre-norm layer it describes (MoE, tensor/expert parallel, a subclassed module)."""
        return dense_stack(self.config, self.model.layers)

    def _stored_head(self) -> Tensor:
        """The LM-head weight as the model holds it (the embeddings' when the config ties them)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def lm_head_fp32(self) -> Tensor:
        """The LM-head weight in fp32; the cast is exact and differentiable."""
        return self._stored_head().float()

    def lm_head_weight(self) -> Tensor:
        """The LM-head weight the logprobs multiply by: under autograd the differentiable fp32 cast
        (:meth:`lm_head_fp32`); without it, the weight as stored. Every backend gives a bf16 head the
        bits of its exact fp32 widening (``Backend.lm_logits``), so both give the same bits; the stored
        one reads half the bytes per decode step and needs no fp32 copy."""
        return self.lm_head_fp32() if torch.is_grad_enabled() else self._stored_head()

    def logprobs(self, hidden: Tensor, temperature: Tensor, ops: Backend | None = None,
                 truncation: RowTruncation | None = None) -> Tensor:
        """fp32 log-softmax over the vocabulary of the rows of ``hidden`` at per-row ``temperature``,
        then the per-row top-k / top-p / min-p ``truncation`` (``Backend.truncate_logprobs``) when given."""
        ops = ops or self.ops
        lp = ops.logprobs(hidden, self.lm_head_weight(), temperature)
        return lp if truncation is None else ops.truncate_logprobs(lp, truncation)

    def token_logprobs(self, hidden: Tensor, temperature: Tensor, targets: Tensor,
                       ops: Backend | None = None, truncation: RowTruncation | None = None) -> Tensor:
        """fp32 ``[N]``: :meth:`logprobs` at each row's ``targets``, the same bits (the trainer's
        path: under autograd its backward skips the ``[N, V]`` intermediates)."""
        return (ops or self.ops).token_logprobs(hidden, self.lm_head_weight(), temperature, targets, truncation)

    def token_logprobs_entropy(self, hidden: Tensor, temperature: Tensor, targets: Tensor,
                               ops: Backend | None = None, truncation: RowTruncation | None = None,
                               ) -> tuple[Tensor, Tensor]:
        """:meth:`token_logprobs` (the same bits) and each row's entropy of the distribution it reads,
        both differentiable (the trainer's path when it measures or regularises the entropy)."""
        return (ops or self.ops).token_logprobs_entropy(hidden, self.lm_head_weight(), temperature, targets,
                                                        truncation)
