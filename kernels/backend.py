"""The operator-set interface every backend implements (reference, fast, ascend).

Models are built only from these operators, and both engines (trainer and rollout) call the same
model code, so the training path and the inference path share one implementation of every op.
A backend is constructed from a ``KernelConfig``; its arithmetic depends only on that config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor

from .config import KernelConfig
from .kv import AttentionBatch, KVSource


@dataclass(frozen=True)
class MoERouting:
    """Top-k routing of N rows: ``experts[n, r]`` is the r-th ranked expert of row n (ties go to the
    lower expert id) and ``weights[n, r]`` its fp32 combine weight."""

    weights: Tensor  # [N, k] fp32
    experts: Tensor  # [N, k] int64


class Backend(ABC):
    """One operator set. Every method is row-wise: output row i depends only on input row i (and,
    for attention, on the K/V of row i's own sequence at positions <= its own)."""

    name: str = "abstract"

    def __init__(self, config: KernelConfig) -> None:
        self.config = config

    @property
    def fingerprint(self) -> str:
        return self.config.fingerprint

    @abstractmethod
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` for 2-D ``x [N, K]`` and ``weight [Out, K]``."""

    @abstractmethod
    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dim, statistics in fp32, HF's cast/multiply order."""

    @abstractmethod
    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary embedding of ``x [N, H, D]`` with per-row ``cos``/``sin`` ``[N, D]`` (fp32 table rows)."""

    @abstractmethod
    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        """Causal attention of packed queries ``q [N, Hq, D]`` over ``kv`` (GQA by head mapping)."""

    @abstractmethod
    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up``."""

    @abstractmethod
    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        """Softmax over experts in fp32, top-k with ties to the lower id, optional renormalisation."""

    @abstractmethod
    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        """Weighted sum of ``expert_out [N, k, H]`` over the k ranks."""

    @abstractmethod
    def logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor) -> Tensor:
        """fp32 log-softmax of ``(hidden @ lm_head.T) / temperature`` over the full vocabulary;
        ``temperature`` is a per-row fp32 tensor ``[N]``."""
