"""Per-operator capture: record every operator call of a forward pass, with no model changes.

``CapturingBackend(inner)`` implements the ``Backend`` interface by delegating to ``inner`` and
recording the inputs and output of each call into a ``CaptureLog``. ``capture_modules(model, log)``
installs forward pre-hooks/hooks on every submodule so the log knows which module (and so which
layer) is running when an operator is called; it also records the embedding lookup, which is not an
operator of the set but is where token ids (tokenization) and the embedding table (weights) enter.

Every call gets a key ``(module, op, index)`` — ``index`` counts calls of ``op`` by ``module``
within one forward (RoPE is called twice by an attention module: q then k) — and, for each output
row, the index of the forward's token row it belongs to (``rows``), so the doctor can align calls of
two paths by key and by token position whatever their batching: a whole teacher-forced sequence in
one call on the training path, a prefill chunk then one row per decode step on the rollout path.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from onpolicy.kernels import AttentionBatch, Backend, KernelConfig, KVSource, MoERouting, PagedKV
from onpolicy.kernels.backend import at_targets
from onpolicy.kernels.truncation import RowTruncation

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_EXPERT = re.compile(r"\.experts\.(\d+)(?:\.|$)")


def layer_of(module: str) -> int | None:
    """Decoder layer index named in a qualified module name (``model.layers.3.mlp`` -> 3)."""
    m = _LAYER.search(module)
    return int(m.group(1)) if m else None


@dataclass
class OpCall:
    """One recorded operator call."""

    order: int
    """Position of the call in the log (execution order)."""
    forward: int
    """Index of the forward pass (``CaptureLog.forwards``) the call belongs to."""
    module: str
    layer: int | None
    op: str
    index: int
    """Occurrence of ``(module, op)`` within its forward."""
    rows: Tensor
    """For each output row, the index of the forward's token row it computes."""
    inputs: dict[str, object]
    output: object
    backend: str
    config: KernelConfig | None

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.module, self.op, self.index)


@dataclass
class Forward:
    index: int
    positions: Tensor
    """Logical token position of every token row of this forward."""
    label: str = ""


@dataclass
class CaptureLog:
    """Calls and forward passes recorded by a ``CapturingBackend`` and its module hooks."""

    calls: list[OpCall] = field(default_factory=list)
    forwards: list[Forward] = field(default_factory=list)
    enabled: bool = True
    _stack: list[str] = field(default_factory=list)
    _rows: list[Tensor | None] = field(default_factory=list)
    _counts: dict[tuple[str, str], int] = field(default_factory=dict)
    _routing: dict[int | None, MoERouting] = field(default_factory=dict)

    def begin_forward(self, positions: Tensor, label: str = "") -> Forward:
        """Start a new forward pass whose token rows sit at ``positions``."""
        fwd = Forward(len(self.forwards), positions.detach().cpu().clone(), label)
        self.forwards.append(fwd)
        self._counts.clear()
        self._routing.clear()
        return fwd

    @property
    def module(self) -> str:
        return self._stack[-1] if self._stack else ""

    @contextmanager
    def scope(self, module: str, rows: Tensor | None = None) -> Iterator[None]:
        """Label calls made outside any module (e.g. the LM head), optionally with their token rows."""
        self._stack.append(module)
        self._rows.append(rows)
        try:
            yield
        finally:
            self._stack.pop()
            self._rows.pop()

    def push(self, module: str) -> None:
        self._stack.append(module)
        self._rows.append(None)

    def pop(self) -> None:
        self._stack.pop()
        self._rows.pop()

    def _rows_for(self, op: str, n: int, module: str, layer: int | None) -> Tensor:
        explicit = self._rows[-1] if self._rows else None
        if explicit is not None:
            return explicit.detach().cpu().reshape(-1)
        m = _EXPERT.search(module)
        routing = self._routing.get(layer)
        if m is not None and routing is not None:  # an expert runs on the rows routed to it
            rows = (routing.experts == int(m.group(1))).nonzero()[:, 0].cpu()
            if rows.numel() == n:
                return rows
        return torch.arange(n)

    def record(self, op: str, inputs: dict[str, object], output: object, backend: str,
               config: KernelConfig | None) -> None:
        if not self.enabled:
            return
        if not self.forwards:
            raise RuntimeError("CaptureLog.begin_forward must be called before operators run")
        module = self.module
        layer = layer_of(module)
        count_key = (module, op)
        index = self._counts.get(count_key, 0)
        self._counts[count_key] = index + 1
        first = output.weights if isinstance(output, MoERouting) else output
        n = int(first.shape[0]) if isinstance(first, Tensor) else 0
        if isinstance(output, MoERouting):
            self._routing[layer] = output
        rows = self._rows_for(op, n, module, layer)
        self.calls.append(OpCall(len(self.calls), len(self.forwards) - 1, module, layer, op, index, rows, inputs,
                                 output, backend, config))


class CapturingBackend(Backend):
    """A ``Backend`` that delegates every operator to ``inner`` and records the call in ``log``."""

    def __init__(self, inner: Backend, log: CaptureLog | None = None) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.name = inner.name
        self.log = log if log is not None else CaptureLog()

    def _rec(self, op: str, inputs: dict[str, object], out: object) -> None:
        self.log.record(op, inputs, out, self.inner.name, self.inner.config)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        y = self.inner.linear(x, weight)
        self._rec("linear", {"x": x, "weight": weight}, y)
        return y

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y = self.inner.rmsnorm(x, weight, eps)
        self._rec("rmsnorm", {"x": x, "weight": weight, "eps": eps}, y)
        return y

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        y = self.inner.rope(x, cos, sin)
        self._rec("rope", {"x": x, "cos": cos, "sin": sin}, y)
        return y

    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        y = self.inner.attention(q, kv, batch, scale)
        if self.log.enabled:
            # copies: a paged cache is overwritten in place by later steps
            k, v = kv.dense(batch.max_kv_len)
            kind, page = ("paged", kv.page_size) if isinstance(kv, PagedKV) else ("contiguous", 0)
            self._rec("attention", {"q": q, "k": k.clone(), "v": v.clone(), "batch": batch, "scale": scale,
                                    "kv_kind": kind, "page_size": page}, y)
        return y

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        y = self.inner.swiglu(gate, up)
        self._rec("swiglu", {"gate": gate, "up": up}, y)
        return y

    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        y = self.inner.moe_route(router_logits, top_k, normalize)
        self._rec("moe_route", {"router_logits": router_logits, "top_k": top_k, "normalize": normalize}, y)
        return y

    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        y = self.inner.moe_combine(expert_out, routing)
        self._rec("moe_combine", {"expert_out": expert_out, "routing": routing}, y)
        return y

    def lm_logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        return self.inner.lm_logits(hidden, lm_head)

    def logprobs_of_logits(self, logits: Tensor, temperature: Tensor) -> Tensor:
        return self.inner.logprobs_of_logits(logits, temperature)

    def logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor) -> Tensor:
        y = self.inner.logprobs(hidden, lm_head, temperature)
        # the head as the values it multiplies by (fp32): a bf16 head as stored is the same operand
        self._rec("logprobs", {"hidden": hidden, "lm_head": lm_head.float(), "temperature": temperature}, y)
        return y

    def truncate_logprobs(self, logprobs: Tensor, truncation: RowTruncation | None) -> Tensor:
        y = self.inner.truncate_logprobs(logprobs, truncation)
        if truncation is not None:
            self._rec("truncate", {"logprobs": logprobs, "top_k": truncation.top_k, "top_p": truncation.top_p,
                                   "min_p": truncation.min_p}, y)
        return y

    def token_logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor, targets: Tensor,
                       truncation: RowTruncation | None = None) -> Tensor:
        # the recorded log-softmax must stay what it was: TokenLogprobs' backward would overwrite it
        return at_targets(self.truncate_logprobs(self.logprobs(hidden, lm_head, temperature), truncation), targets)


@contextmanager
def capture_modules(model: nn.Module, log: CaptureLog) -> Iterator[CaptureLog]:
    """Tell ``log`` which submodule of ``model`` is running (forward pre-hooks / hooks), and record
    embedding lookups as op ``embedding``. Only forwards on the calling thread are tracked (the
    ``CapturingBackend`` must not be shared with other threads). The hooks are removed on exit."""
    handles = []
    owner = threading.get_ident()  # a forward of the same model on another thread is not ours
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(_m: nn.Module, _args: object, name: str = name) -> None:
            if threading.get_ident() == owner:
                log.push(name)

        def post(m: nn.Module, args: tuple, out: object) -> None:
            if threading.get_ident() != owner:
                return
            if isinstance(m, nn.Embedding) and log.enabled:
                log.record("embedding", {"ids": args[0], "weight": m.weight}, out, "torch", None)
            log.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield log
    finally:
        for h in handles:
            h.remove()
