"""The operator-set interface every backend implements (reference, fast, ascend).

Models are built only from these operators, and both engines (trainer and rollout) call the same
model code, so the training path and the inference path share one implementation of every op.
A backend is constructed from a ``KernelConfig``; its arithmetic depends only on that config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
from torch import Tensor

from .config import KernelConfig
from .kv import AttentionBatch, KVSource, PagedCacheWrite
from .truncation import RowTruncation, truncate


@dataclass(frozen=True)
class MoERouting:
    """Top-k routing of N rows: ``experts[n, r]`` is the r-th ranked expert of row n (ties go to the
    lower expert id) and ``weights[n, r]`` its fp32 combine weight."""

    weights: Tensor  # [N, k] fp32
    experts: Tensor  # [N, k] int64


class ShardGroup(Protocol):
    """The ranks one tensor is sharded over (tensor- or expert-parallel), as the operators see them:
    ``degree`` shards, this rank holds shard ``index``. Implemented over torch.distributed by
    ``onpolicy.parallel``; ``SINGLE`` is the unsharded case (every method is the identity)."""

    degree: int
    index: int

    def gather(self, t: Tensor) -> Tensor:
        """Concatenation along dim 0 of ``t`` of shards ``0..degree-1`` in shard order (exact: no
        arithmetic). Under autograd the gradient of this rank's part flows back to ``t``."""
        ...

    def all_reduce(self, t: Tensor) -> Tensor:
        """Plain sum of ``t`` over the shards, in whatever order the transport uses (fast mode only)."""
        ...

    def enter(self, t: Tensor) -> Tensor:
        """Identity in the forward pass; in the backward pass the gradient is summed over the shards
        (a replicated activation entering a sharded computation)."""
        ...


class _Single:
    degree = 1
    index = 0

    def gather(self, t: Tensor) -> Tensor:
        return t

    def all_reduce(self, t: Tensor) -> Tensor:
        return t

    def enter(self, t: Tensor) -> Tensor:
        return t


SINGLE: ShardGroup = _Single()
"""The unsharded group (degree 1)."""


@dataclass(frozen=True)
class ModelParallel:
    """The groups a model's operators reduce over: tensor parallel (``tp``) and expert parallel
    (``ep``); both ``SINGLE`` for an unsharded model (``onpolicy.parallel.parallelize`` shards one)."""

    tp: ShardGroup = field(default=SINGLE)
    ep: ShardGroup = field(default=SINGLE)


class RowWeight(Protocol):
    """The weight of a row-parallel linear as this rank holds it."""

    weight: Tensor
    """``[Out, K_local]``: the rank's contiguous slice of the input dim."""

    def chunked(self, chunks: int) -> Tensor:
        """``[chunks, Out, K_local / chunks]`` contiguous: chunk ``i`` is columns
        ``[i*Kc, (i+1)*Kc)`` of ``weight``, laid out the same whatever the TP degree."""
        ...


@dataclass(frozen=True)
class DenseLayer:
    """One dense decoder layer's parameters as :meth:`Backend.decoder_stack` reads them (the model's
    ``DecoderLayer`` with an MLP, unsharded). Absent biases and q/k norms are None."""

    input_norm: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: RowWeight
    o_bias: Tensor | None
    post_norm: Tensor
    gate: Tensor
    up: Tensor
    down: RowWeight


@dataclass(frozen=True)
class DenseStack:
    """Every decoder layer of a dense, unsharded model, and the sizes they share."""

    layers: tuple[DenseLayer, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    """Every RMSNorm's epsilon."""
    scale: float
    """Attention's score scale."""
    cache: dict[object, object] = field(default_factory=dict, init=False, repr=False, compare=False)
    """A backend's own state derived from these layers (e.g. their weights' addresses), keyed by it."""

    def tensors(self) -> list[Tensor]:
        """Every parameter tensor of every layer (a row-parallel weight as its ``weight``), in order
        (the same objects for the stack's lifetime: listed once)."""
        out = self.cache.get("tensors")
        if out is None:
            out = self.cache["tensors"] = [t if isinstance(t, Tensor) else t.weight for layer in self.layers
                                           for f in fields(layer) if (t := getattr(layer, f.name)) is not None]
        return out  # type: ignore[return-value]


def chunk_major(weight: Tensor, chunks: int) -> Tensor:
    """``weight [Out, K]`` as ``[chunks, Out, K / chunks]`` contiguous (the ``RowWeight.chunked`` layout)."""
    if weight.shape[1] % chunks:
        raise ValueError(f"{chunks} reduction chunks do not divide the input dim {weight.shape[1]}")
    return weight.view(weight.shape[0], chunks, weight.shape[1] // chunks).transpose(0, 1).contiguous()


def divide_by_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """fp32 ``logits [N, V] / temperature[:, None]``. ``x / 1.0`` is ``x`` for every float (IEEE), so
    when every temperature is exactly 1 the logits are returned as they are: the same bits without a
    pass over ``[N, V]`` (and its backward)."""
    if bool((temperature == 1).all()):
        return logits
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return logits.div_(temperature[:, None])  # the caller's fresh logits; the same division
    return logits / temperature[:, None]


def at_targets(logprobs: Tensor, targets: Tensor) -> Tensor:
    """``logprobs [N, V]`` at each row's ``targets [N]`` (int64): ``[N]``."""
    return logprobs.gather(1, targets[:, None])[:, 0]


class TokenLogprobs(torch.autograd.Function):
    """``Backend.token_logprobs`` under autograd. Forward: ``logprobs`` (called with autograd off,
    so its bits are the no-grad path's) and the gather; the full log-softmax is saved. Backward, for
    the gradient ``g`` of row n's token logprob: ``d logits = (onehot(target) - softmax) * g / t``,
    computed in place in the saved log-softmax (one exp pass, one scale pass, one scatter), then the
    two GEMMs of the LM head in fp32. With truncation the saved log-softmax is the truncated one:
    ``exp(-inf) = 0`` gives excluded tokens a zero gradient (the kept set is a constant). A second
    backward through the same graph is refused by autograd (the saved tensor has changed), never
    silently wrong."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, temperature: Tensor, targets: Tensor,  # type: ignore[override]
                logprobs: object) -> Tensor:
        lp = logprobs(hidden, lm_head, temperature)  # type: ignore[operator]
        ctx.save_for_backward(hidden, lm_head, lp, temperature, targets)
        return at_targets(lp, targets)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, lm_head, lp, temperature, targets = ctx.saved_tensors
        scale = (grad.float() / temperature.float())[:, None]
        dlogits = lp.exp_().mul_(-scale).scatter_add_(1, targets[:, None], scale)
        gx = dlogits.mm(lm_head.float()).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = dlogits.t().mm(hidden.float()).to(lm_head.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None


def _entropy_of(lp: Tensor) -> Tensor:
    """fp32 ``[N]``: ``-sum_v exp(lp) * lp`` of a log-softmax ``lp [N, V]`` (a token of probability 0
    contributes 0)."""
    return -(lp.exp() * lp).nan_to_num_(nan=0.0).sum(-1)


class TokenLogprobsEntropy(torch.autograd.Function):
    """``Backend.token_logprobs_entropy`` under autograd: ``TokenLogprobs`` plus the entropy of each
    row's distribution, both read from the one saved log-softmax. Backward, for gradients ``g`` of
    the token logprob and ``h`` of the entropy ``H``: ``d logits = (onehot(target) - p) * g / t
    - p * (lp + H) * h / t``. When the entropy is not differentiated (``h`` is None) the backward
    is ``TokenLogprobs``'s, the same operations in the same order (the same bits)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, temperature: Tensor, targets: Tensor,  # type: ignore[override]
                logprobs: object) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        lp = logprobs(hidden, lm_head, temperature)  # type: ignore[operator]
        entropy = _entropy_of(lp)
        ctx.save_for_backward(hidden, lm_head, lp, temperature, targets, entropy)
        return at_targets(lp, targets), entropy

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, lm_head, lp, temperature, targets, entropy = ctx.saved_tensors
        if grad is None:
            grad = torch.zeros_like(entropy)
        scale = (grad.float() / temperature.float())[:, None]
        if grad_entropy is None:
            dlogits = lp.exp_().mul_(-scale).scatter_add_(1, targets[:, None], scale)
        else:
            p = lp.exp()
            h = (grad_entropy.float() / temperature.float())[:, None]
            dlogits = lp.add_(entropy[:, None]).mul_(p).mul_(-h).nan_to_num_(nan=0.0)
            dlogits.sub_(p.mul_(scale)).scatter_add_(1, targets[:, None], scale)
        gx = dlogits.mm(lm_head.float()).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = dlogits.t().mm(hidden.float()).to(lm_head.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None


def fold_chunks(partials: Tensor) -> Tensor:
    """The canonical reduction: ``partials [C, ...]`` summed left to right in chunk order in fp32."""
    acc = partials[0].float()
    for i in range(1, partials.shape[0]):
        acc = acc + partials[i].float()
    return acc


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

    #: Whether :meth:`linears` computes a group of projections in one call: the model then calls it
    #: for q/k/v and gate/up instead of one ``linear`` per projection module (a backend that wraps
    #: another, like the doctor's capture, keeps the per-module calls).
    groups_projections: bool = False

    def linears(self, x: Tensor, weights: Sequence[Tensor]) -> list[Tensor]:
        """The projections ``[linear(x, w) for w in weights]`` of one input. A backend may compute
        them together; each output keeps the bits of its own ``linear``."""
        return [self.linear(x, w) for w in weights]

    def row_linear(self, x: Tensor, weight: RowWeight, group: ShardGroup = SINGLE) -> Tensor:
        """Row-parallel ``x @ W.T`` where ``W``'s input dim K is sharded over ``group`` and ``x [N, K_local]``
        holds this rank's K slice; returns the full ``[N, Out]`` on every rank.

        Consistent backends use the canonical reduction: K is split into ``config.reduce_chunks``
        chunks (this rank owns ``reduce_chunks / degree`` of them), each chunk's partial is one
        ``linear`` call on contiguous operands of the same shape at every degree, the partials are
        gathered in chunk order and folded left to right in fp32 (``fold_chunks``) — so the bits do
        not depend on the degree. The fast backend computes one plain ``linear`` on the local slice
        and sums the ranks' outputs with a plain all-reduce (bits depend on the degree)."""
        if not self.config.consistent:
            return group.all_reduce(self.linear(x, weight.weight))
        partials = self.chunk_partials(x, weight.chunked(self.config.reduce_chunks // group.degree))
        return fold_chunks(group.gather(partials)).to(x.dtype)

    def chunk_partials(self, x: Tensor, chunks: Tensor) -> Tensor:
        """``[C, N, Out]``: partial ``i`` is ``x[:, i*Kc:(i+1)*Kc] @ chunks[i].T`` for ``chunks [C, Out, Kc]``.
        A partial's bits must not depend on C (certified by the selftest's row-parallel probe); this
        default is one ``linear`` call per chunk on contiguous operands."""
        kc = chunks.shape[2]
        return torch.stack([self.linear(x[:, i * kc:(i + 1) * kc].contiguous(), chunks[i])
                            for i in range(chunks.shape[0])])

    def decoder_stack(self, x: Tensor, stack: DenseStack, cos: Tensor, sin: Tensor, cache: PagedCacheWrite,
                      batch: AttentionBatch) -> Tensor | None:
        """Every layer of ``stack`` over the packed rows ``x [N, H]`` in one call, without autograd,
        writing the new K/V rows through ``cache``: the residual stream after the last layer (before
        the final norm), with the bits of the layers run one operator at a time. None when this
        backend has no such call or not for these operands; the model then runs the layers one
        operator at a time (this default)."""
        return None

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
    def lm_logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        """fp32 logits ``hidden @ lm_head.T`` ``[N, V]`` (the LM head of :meth:`logprobs`). ``lm_head`` is
        fp32, or bf16 as the model stores it (``CausalLM.lm_head_weight`` without autograd): a bf16
        head gives the bits of its exact fp32 widening."""

    def logprobs_of_logits(self, logits: Tensor, temperature: Tensor) -> Tensor:
        """fp32 log-softmax of fresh fp32 ``logits [N, V] / temperature[:, None]`` (the second half of
        :meth:`logprobs`; may divide ``logits`` in place)."""
        return torch.log_softmax(divide_by_temperature(logits, temperature), dim=-1)

    def logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor) -> Tensor:
        """fp32 log-softmax of ``(hidden @ lm_head.T) / temperature`` over the full vocabulary;
        ``temperature`` is a per-row fp32 tensor ``[N]``: :meth:`lm_logits`, then
        :meth:`logprobs_of_logits` (an engine that computes the logits in one place and samples in
        another, like vLLM, calls the two halves and gets these bits)."""
        return self.logprobs_of_logits(self.lm_logits(hidden, lm_head), temperature)

    def truncate_logprobs(self, logprobs: Tensor, truncation: RowTruncation | None) -> Tensor:
        """The top-k / top-p / min-p truncated, renormalised ``logprobs [N, V]`` (``kernels.truncation``:
        rows without active truncation keep their bits). Rollout and trainer both apply it to the
        bits of :meth:`logprobs`, so the distribution sampled is the one scored."""
        return truncate(logprobs, truncation)

    def token_logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor, targets: Tensor,
                       truncation: RowTruncation | None = None) -> Tensor:
        """fp32 ``[N]``: ``truncate_logprobs(logprobs(hidden, lm_head, temperature), truncation)`` at
        each row's ``targets`` (int64 ``[N]``), with the bits of that gather. Under autograd the forward
        is that call itself and the backward is the analytic gradient in place over the saved
        (truncated) log-softmax (``TokenLogprobs``: excluded tokens get a zero gradient), instead of
        autograd's gather / log-softmax / division backward passes, each a fresh ``[N, V]`` tensor."""
        def full(h: Tensor, w: Tensor, t: Tensor) -> Tensor:
            return self.truncate_logprobs(self.logprobs(h, w, t), truncation)

        differentiable = hidden.requires_grad or lm_head.requires_grad
        if torch.is_grad_enabled() and differentiable and not temperature.requires_grad:
            return TokenLogprobs.apply(hidden, lm_head, temperature, targets, full)
        return at_targets(full(hidden, lm_head, temperature), targets)

    def token_logprobs_entropy(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor, targets: Tensor,
                               truncation: RowTruncation | None = None) -> tuple[Tensor, Tensor]:
        """fp32 ``[N]`` twice: :meth:`token_logprobs` (the same bits) and the entropy of each row's
        distribution (the one :meth:`token_logprobs` reads, truncated when ``truncation`` is given),
        from the same log-softmax. Under autograd both are differentiable with the analytic backward
        (``TokenLogprobsEntropy``)."""
        def full(h: Tensor, w: Tensor, t: Tensor) -> Tensor:
            return self.truncate_logprobs(self.logprobs(h, w, t), truncation)

        differentiable = hidden.requires_grad or lm_head.requires_grad
        if torch.is_grad_enabled() and differentiable and not temperature.requires_grad:
            return TokenLogprobsEntropy.apply(hidden, lm_head, temperature, targets, full)
        lp = full(hidden, lm_head, temperature)
        return at_targets(lp, targets), _entropy_of(lp)
