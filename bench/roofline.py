"""This machine's measured limits: memory read bandwidth and peak GEMM throughput, and the bounds
they put on a model's decode: batch-1 decode must read every weight once per token (bandwidth
bound); a large batch must do ~2 flops per weight per token (compute bound)."""

from __future__ import annotations

import torch

from onpolicy.models.causal_lm import CausalLM

from .common import median_time


def read_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of a full read of a ``mib`` MiB fp32 tensor (``sum``; median), far beyond the caches."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / median_time(lambda: x.sum(), repeats)


def gemm_flops(dtype: torch.dtype, n: int, repeats: int) -> float:
    """Flops/s of an ``n x n x n`` matmul in ``dtype`` (median)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    return 2 * n**3 / median_time(lambda: a @ b, repeats)


def _body_weights(model: CausalLM) -> list[torch.Tensor]:
    """Every parameter but the embedding table and the LM head."""
    skip = {id(model.model.embed_tokens.weight)} | ({id(model.lm_head.weight)} if model.lm_head is not None else set())
    return [p for p in model.parameters() if id(p) not in skip]


def _head(model: CausalLM) -> torch.Tensor:
    """The LM-head weight a decode step multiplies by: as stored (no fp32 copy made)."""
    with torch.no_grad():
        return model.lm_head_weight()


def decode_weight_bytes(model: CausalLM) -> int:
    """Bytes one decode step reads at least once: every weight except the embedding table (one row
    per token), plus the LM head as stored (the consistent head widens a bf16 weight inside the
    product instead of reading an fp32 copy)."""
    total = sum(p.numel() * p.element_size() for p in _body_weights(model))
    head = _head(model)
    return total + head.numel() * head.element_size()


def matmul_params(model: CausalLM) -> int:
    """Weights that take part in a GEMM per token (all but the embedding table and the norms; the LM
    head counted once, tied or not)."""
    body = sum(p.numel() for p in _body_weights(model) if p.dim() == 2)
    return body + _head(model).numel()
