"""Aligning two capture logs by operator key and token position, and re-running one call.

A path's calls for one key ``(module, op, index)`` may be spread over many forwards (the rollout:
a prefill, then one row per decode step) or sit in one (the training path). ``KeyRows`` flattens
them into one table of rows indexed by logical token position, so the two paths compare row by row
(bitwise) at every position both computed. ``swap_call`` rebuilds one rollout call from the
training path's rows (same call shape: same row count, same positions, same KV layout) so the
rollout's operator can be re-run on the trainer's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from onpolicy.kernels import AttentionBatch, Backend, ContiguousKV, MoERouting, PagedKV
from onpolicy.kernels.truncation import RowTruncation

from .capture import CaptureLog, OpCall

Key = tuple[str, str, int]
_MAX_TILE = 4096

#: Inputs that have one row per output row, per operator.
ROW_INPUTS: dict[str, tuple[str, ...]] = {
    "embedding": ("ids",), "linear": ("x",), "rmsnorm": ("x",), "rope": ("x", "cos", "sin"), "attention": ("q",),
    "swiglu": ("gate", "up"), "moe_route": ("router_logits",), "moe_combine": ("expert_out", "routing"),
    "logprobs": ("hidden", "temperature"), "truncate": ("logprobs", "top_k", "top_p", "min_p"),
}
#: Whole-tensor inputs (weights), per operator.
PARAM_INPUTS: dict[str, tuple[str, ...]] = {
    "embedding": ("weight",), "linear": ("weight",), "rmsnorm": ("weight",), "logprobs": ("lm_head",),
}
#: Scalar inputs, per operator.
SCALAR_INPUTS: dict[str, tuple[str, ...]] = {"rmsnorm": ("eps",), "attention": ("scale",),
                                             "moe_route": ("top_k", "normalize")}


def parts(value: object) -> list[tuple[str, Tensor]]:
    """The tensors of an operator input or output (a ``MoERouting`` has two)."""
    if isinstance(value, MoERouting):
        return [("weights", value.weights), ("experts", value.experts)]
    if isinstance(value, Tensor):
        return [("", value)]
    return []


def bitwise_rows(a: Tensor, b: Tensor) -> Tensor:
    """Per row (dim 0): True where ``a`` and ``b`` differ in any bit (or in dtype/shape)."""
    n = a.shape[0]
    if a.dtype != b.dtype or a.shape != b.shape:
        return torch.ones(n, dtype=torch.bool)
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return (a != b).reshape(n, -1).any(1) if n else torch.zeros(0, dtype=torch.bool)


def max_abs(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape or not a.numel():
        return float("inf") if a.shape != b.shape else 0.0
    d = (a.double() - b.double()).abs()
    same = a.double() == b.double()  # equal infinities give NaN differences
    d = torch.where(same, torch.zeros_like(d), d).nan_to_num(nan=float("inf"))
    return float(d.max())


@dataclass
class KeyRows:
    """Every row one path computed for one operator key, by logical token position."""

    calls: list[OpCall]
    positions: Tensor
    """Position of every flattened row (calls in order, rows in call order)."""
    where: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """position -> (flat index, call index, row in call); the last call wins."""

    @classmethod
    def build(cls, log: CaptureLog, calls: list[OpCall]) -> KeyRows:
        pos = [log.forwards[c.forward].positions[c.rows] for c in calls]
        kr = cls(calls, torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64))
        flat = 0
        for ci, p in enumerate(pos):
            for j, q in enumerate(p.tolist()):
                kr.where[q] = (flat + j, ci, j)
            flat += len(p)
        return kr

    def flat(self, get: Callable[[OpCall], object]) -> list[tuple[str, Tensor]]:
        """Row tensors of an input/output, concatenated over calls (flat row order)."""
        per_call = [parts(get(c)) for c in self.calls]
        return [(name, torch.cat([pc[i][1] for pc in per_call])) for i, (name, _) in enumerate(per_call[0])]

    @cached_property
    def outputs(self) -> list[tuple[str, Tensor]]:
        return self.flat(lambda c: c.output)

    def index(self, positions: list[int]) -> Tensor:
        return torch.tensor([self.where[p][0] for p in positions], dtype=torch.int64)


@dataclass
class KeyDiff:
    key: Key
    layer: int | None
    op: str
    compared: int
    """Positions both paths computed."""
    differing: list[int]
    """Positions whose output rows differ (ascending)."""
    max_abs_diff: float
    only_rollout: int = 0
    only_trainer: int = 0

    @property
    def divergent(self) -> bool:
        return bool(self.differing)


def group(log: CaptureLog) -> tuple[list[Key], dict[Key, list[OpCall]]]:
    """Calls by key, and the keys in order of first execution."""
    order: list[Key] = []
    by: dict[Key, list[OpCall]] = {}
    for c in log.calls:
        if c.key not in by:
            by[c.key] = []
            order.append(c.key)
        by[c.key].append(c)
    return order, by


def compare_key(key: Key, r: KeyRows, t: KeyRows) -> KeyDiff:
    common = sorted(set(r.where) & set(t.where))
    c0 = t.calls[0]
    diff = KeyDiff(key, c0.layer, c0.op, len(common), [], 0.0, len(set(r.where) - set(t.where)),
                   len(set(t.where) - set(r.where)))
    if not common:
        return diff
    ri, ti = r.index(common), t.index(common)
    bad = torch.zeros(len(common), dtype=torch.bool)
    for (_, a), (_, b) in zip(r.outputs, t.outputs, strict=True):
        ra, tb = a[ri], b[ti]
        rows = bitwise_rows(ra, tb)
        bad |= rows
        if rows.any():
            diff.max_abs_diff = max(diff.max_abs_diff, max_abs(ra[rows], tb[rows]))
    diff.differing = [p for p, b in zip(common, bad.tolist(), strict=True) if b]
    return diff


def _attended(call: OpCall, row: int) -> tuple[int, int]:
    """(sequence, attended position) of one query row of an attention call."""
    batch: AttentionBatch = call.inputs["batch"]  # type: ignore[assignment]
    s, i = (batch.q_index == row).nonzero()[0].tolist()
    return s, int(batch.q_pos[s, i])


def _kv_for(call: OpCall, row: int) -> tuple[int, Tensor, Tensor]:
    """(attended position, visible K, visible V) of one query row of an attention call."""
    s, p = _attended(call, row)
    k, v = call.inputs["k"], call.inputs["v"]
    return p, k[s, :p + 1], v[s, :p + 1]  # type: ignore[index]


def attention_inputs(r: KeyRows, t: KeyRows, positions: list[int]) -> tuple[list[int], int | None]:
    """For attention rows at ``positions``: the positions whose mask (attended position) differs,
    and the first K/V position that differs between the paths (None if all visible K/V agree)."""
    mask, first_kv = [], None
    for p in positions:
        _, rc, rj = r.where[p]
        _, tc, tj = t.where[p]
        rp, rk, rv = _kv_for(r.calls[rc], rj)
        tp, tk, tv = _kv_for(t.calls[tc], tj)
        if rp != tp:
            mask.append(p)
            continue
        bad = bitwise_rows(rk, tk) | bitwise_rows(rv, tv)
        if bad.any():
            d = int(bad.nonzero()[0])
            first_kv = d if first_kv is None else min(first_kv, d)
    return mask, first_kv


def swap_call(call: OpCall, r: KeyRows, t: KeyRows, log: CaptureLog) -> dict[str, object] | None:
    """The inputs of rollout ``call`` with every value taken from the training path (rows at the
    same positions, the trainer's weights and scalars), keeping the rollout call's shape. None if
    the trainer lacks one of the call's positions."""
    positions = log.forwards[call.forward].positions[call.rows].tolist()
    if any(p not in t.where for p in positions):
        return None
    idx = t.index(positions)
    t0 = t.calls[0]
    inputs = dict(call.inputs)
    for name in ROW_INPUTS[call.op]:
        flat = dict(t.flat(lambda c, name=name: c.inputs[name]))
        if isinstance(call.inputs[name], MoERouting):
            inputs[name] = MoERouting(weights=flat["weights"][idx], experts=flat["experts"][idx])
        else:
            inputs[name] = flat[""][idx]
    for name in (*PARAM_INPUTS.get(call.op, ()), *SCALAR_INPUTS.get(call.op, ())):
        inputs[name] = t0.inputs[name]
    if call.op == "attention":
        batch: AttentionBatch = call.inputs["batch"]  # type: ignore[assignment]
        length = batch.max_kv_len
        tk, tv = t0.inputs["k"], t0.inputs["v"]
        if batch.num_seqs != 1 or tk.shape[1] < length:  # type: ignore[union-attr]
            return None
        inputs["kv"] = kv_source(tk[0, :length], tv[0, :length], call)  # type: ignore[index]
        # the trainer's mask too: each row attends to the position the trainer's row attended to
        attended = torch.tensor([_attended(t.calls[t.where[p][1]], t.where[p][2])[1] for p in positions])
        q_pos, valid = batch.q_pos.clone(), batch.q_index >= 0
        q_pos[valid] = attended[batch.q_index[valid]]
        inputs["batch"] = replace(batch, q_pos=q_pos)
    return inputs


def kv_source(k: Tensor, v: Tensor, call: OpCall) -> PagedKV | ContiguousKV:
    """One sequence's K/V ``[L, Hkv, D]`` in the layout ``call`` read them from (pages of the same
    size, or contiguous rows)."""
    length = k.shape[0]
    if call.inputs["kv_kind"] == "paged":
        page = int(call.inputs["page_size"])  # type: ignore[call-overload]
        pages = -(-length // page) + 1  # the last page stays zero: table entries past the end point at it
        pad = (0, 0, 0, 0, 0, pages * page - length)
        kp, vp = F.pad(k, pad).view(pages, page, *k.shape[1:]), F.pad(v, pad).view(pages, page, *v.shape[1:])
        width = max(pages, -(-length // _MAX_TILE + 1) * _MAX_TILE // page)  # room for any reader's KV tile
        table = torch.full((1, width), pages - 1, dtype=torch.int64)
        table[0, :pages - 1] = torch.arange(pages - 1)
        return PagedKV(kp, vp, table)
    return ContiguousKV(k, v, torch.tensor([0, length]))


def own_inputs(call: OpCall) -> dict[str, object] | None:
    """A recorded call's own inputs, in the form ``run_op`` takes (None for a multi-sequence
    attention call, which the doctor never makes)."""
    inputs = dict(call.inputs)
    if call.op == "attention":
        k, v = call.inputs["k"], call.inputs["v"]
        if k.shape[0] != 1:  # type: ignore[union-attr]
            return None
        inputs["kv"] = kv_source(k[0], v[0], call)  # type: ignore[index]
    return inputs


def run_op(backend: Backend | None, op: str, inputs: dict[str, object]) -> object:
    """Call operator ``op`` of ``backend`` with recorded inputs (``embedding`` is a plain lookup)."""
    i = inputs
    if op == "embedding":
        return F.embedding(i["ids"], i["weight"])  # type: ignore[arg-type]
    assert backend is not None
    with torch.no_grad():
        if op == "linear":
            return backend.linear(i["x"], i["weight"])  # type: ignore[arg-type]
        if op == "rmsnorm":
            return backend.rmsnorm(i["x"], i["weight"], i["eps"])  # type: ignore[arg-type]
        if op == "rope":
            return backend.rope(i["x"], i["cos"], i["sin"])  # type: ignore[arg-type]
        if op == "attention":
            return backend.attention(i["q"], i["kv"], i["batch"], i["scale"])  # type: ignore[arg-type]
        if op == "swiglu":
            return backend.swiglu(i["gate"], i["up"])  # type: ignore[arg-type]
        if op == "moe_route":
            return backend.moe_route(i["router_logits"], i["top_k"], i["normalize"])  # type: ignore[arg-type]
        if op == "moe_combine":
            return backend.moe_combine(i["expert_out"], i["routing"])  # type: ignore[arg-type]
        if op == "logprobs":
            return backend.logprobs(i["hidden"], i["lm_head"], i["temperature"])  # type: ignore[arg-type]
        if op == "truncate":
            rows = RowTruncation(i["top_k"], i["top_p"], i["min_p"])  # type: ignore[arg-type]
            return backend.truncate_logprobs(i["logprobs"], rows)  # type: ignore[arg-type]
    raise ValueError(f"unknown operator {op!r}")


def same_output(out: object, want: object) -> bool:
    """Bitwise equality of two operator outputs."""
    a, b = parts(out), parts(want)
    return len(a) == len(b) and all(not bitwise_rows(x, y).any() for (_, x), (_, y) in zip(a, b, strict=True))


def trainer_rows(call: OpCall, t: KeyRows, log: CaptureLog) -> object:
    """The training path's output rows at the positions of (rollout) ``call``."""
    idx = t.index(log.forwards[call.forward].positions[call.rows].tolist())
    out = dict(t.outputs)
    if "weights" in out:
        return MoERouting(weights=out["weights"][idx], experts=out["experts"][idx])
    return out[""][idx]


def shapes(call: OpCall) -> dict[str, list[int]]:
    """Shapes of a call's tensor inputs and output (for the report)."""
    out: dict[str, list[int]] = {}
    for name, value in call.inputs.items():
        for part, tensor in parts(value):
            out[f"{name}.{part}" if part else name] = list(tensor.shape)
    for part, tensor in parts(call.output):
        out[f"out.{part}" if part else "out"] = list(tensor.shape)
    return out
