"""MoE routing and combine: fp32 router softmax, top-k with ties to the lower expert id, combine
in top-k rank order in fp32. Dispatch (which rows go to which expert) is pure indexing."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import MoERouting


def route(router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
    probs = torch.softmax(router_logits.float(), dim=-1)
    # stable descending sort keeps equal probabilities in expert-id order: ties go to the lower id
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = sorted_probs[:, :top_k], order[:, :top_k]
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return MoERouting(weights=weights, experts=experts)


def combine(expert_out: Tensor, routing: MoERouting) -> Tensor:
    acc = expert_out[:, 0].float() * routing.weights[:, :1]
    for r in range(1, expert_out.shape[1]):
        acc = acc + expert_out[:, r].float() * routing.weights[:, r:r + 1]
    return acc.to(expert_out.dtype)


def dispatch(routing: MoERouting, num_experts: int) -> list[tuple[int, Tensor, Tensor]]:
    """For every expert that received rows: ``(expert, rows, ranks)`` with ``rows`` ascending."""
    flat = routing.experts.reshape(-1)
    k = routing.experts.shape[1]
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out: list[tuple[int, Tensor, Tensor]] = []
    start = 0
    for e, c in enumerate(counts):
        if c:
            idx = order[start:start + c]
            out.append((e, idx // k, idx % k))
            start += c
    return out
