"""From two capture logs to a verdict: the first divergent operator and the evidence for its class.

1. Every operator key is compared row by row, bitwise, at every token position both paths computed;
   keys are visited in execution order (the training forward's call order), so at the first
   divergent key every earlier operator agreed at every position.
2. At that key the inputs are compared at the differing positions: activations row by row, weights
   as whole tensors, scalars, and for attention the attended position (mask) and the visible K/V.
3. The rollout call holding the first differing row is re-run (a) on its own inputs (reproducible?),
   (b) with its operator on the trainer's inputs in the rollout's call shape (swap inputs), and
   (c) with the trainer's operator on the same inputs.

Identical inputs + different outputs => an **operator** fault, unless the two paths run the same
backend with different constants and (c) reproduces the trainer (then ``framework/kernel_config``).
Different inputs at the first divergence => a **framework** fault whose cause is read from which
input differs: dtype, token ids (tokenization), a weight (weights), RoPE cos/sin (positions), the
attended position (attention_mask), the LM-head temperature (temperature), the top-k / top-p /
min-p parameters of the logprob truncation (truncation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onpolicy.kernels import get_backend

from .capture import CaptureLog, OpCall
from .doctor_align import (
    PARAM_INPUTS,
    ROW_INPUTS,
    SCALAR_INPUTS,
    Key,
    KeyDiff,
    KeyRows,
    attention_inputs,
    bitwise_rows,
    compare_key,
    group,
    own_inputs,
    run_op,
    same_output,
    shapes,
    swap_call,
    trainer_rows,
)


@dataclass
class Finding:
    """The first divergent operator and what the evidence says about it."""

    klass: str = "none"
    cause: str | None = None
    first: KeyDiff | None = None
    phase: str | None = None
    differing_inputs: list[str] = field(default_factory=list)
    shapes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
    diffs: list[KeyDiff] = field(default_factory=list)
    swap: dict[str, bool | None] = field(default_factory=dict)


def compare_logs(rlog: CaptureLog, tlog: CaptureLog) -> tuple[list[KeyDiff], dict[Key, tuple[KeyRows, KeyRows]]]:
    """Every key both paths ran, in the trainer's execution order, compared row by row."""
    _, r_by = group(rlog)
    t_order, t_by = group(tlog)
    keys = [k for k in t_order if k in r_by]
    diffs, rows = [], {}
    for key in keys:
        r, t = KeyRows.build(rlog, r_by[key]), KeyRows.build(tlog, t_by[key])
        rows[key] = (r, t)
        diffs.append(compare_key(key, r, t))
    return diffs, rows


def _name(call: OpCall) -> str:
    where = f"layer {call.layer}" if call.layer is not None else call.module
    return f"{call.op} at {where} ({call.module}, call {call.index})"


def _input_diffs(op: str, r: KeyRows, t: KeyRows, positions: list[int], ev: list[str]) -> dict[str, str]:
    """Which inputs differ at ``positions``: name -> kind of difference (dtype | value | mask | kv)."""
    out: dict[str, str] = {}
    ri, ti = r.index(positions), t.index(positions)
    for name in ROW_INPUTS[op]:
        rf, tf = r.flat(lambda c, n=name: c.inputs[n]), t.flat(lambda c, n=name: c.inputs[n])
        for (part, a), (_, b) in zip(rf, tf, strict=True):
            label = f"{name}.{part}" if part else name
            if a.dtype != b.dtype:
                out[label] = "dtype"
                ev.append(f"input {label}: dtype {a.dtype} (rollout) vs {b.dtype} (trainer)")
                continue
            bad = bitwise_rows(a[ri], b[ti])
            if bad.any():
                out[label] = "value"
                p = positions[int(bad.nonzero()[0])]
                ev.append(f"input {label} differs at {int(bad.sum())} of {len(positions)} differing rows "
                          f"(first at position {p})")
    c_r, c_t = r.calls[0], t.calls[0]
    for name in PARAM_INPUTS.get(op, ()):
        a, b = c_r.inputs[name], c_t.inputs[name]
        if a.dtype != b.dtype:  # type: ignore[union-attr]
            out[name] = "dtype"
            ev.append(f"weight input {name}: dtype {a.dtype} (rollout) vs {b.dtype} (trainer)")  # type: ignore[union-attr]
        elif a.shape != b.shape or bitwise_rows(a.reshape(1, -1), b.reshape(1, -1)).any():  # type: ignore[union-attr]
            out[name] = "value"
            ev.append(f"weight input {name} {list(a.shape)} differs between the paths")  # type: ignore[union-attr]
    for name in SCALAR_INPUTS.get(op, ()):
        if c_r.inputs[name] != c_t.inputs[name]:
            out[name] = "value"
            ev.append(f"scalar input {name}: {c_r.inputs[name]} (rollout) vs {c_t.inputs[name]} (trainer)")
    if op == "attention":
        mask, first_kv = attention_inputs(r, t, positions)
        if mask:
            out["mask"] = "mask"
            ev.append(f"attended positions differ for {len(mask)} rows (first at position {mask[0]})")
        if first_kv is not None:
            out["kv"] = "value"
            ev.append(f"visible K/V differ from cache position {first_kv}")
    return out


def _cause(op: str, inputs: dict[str, str]) -> str:
    if "dtype" in inputs.values():
        return "dtype"
    if op == "embedding" and "ids" in inputs:
        return "tokenization"
    if any(n in inputs for n in PARAM_INPUTS.get(op, ())):
        return "weights"
    if "cos" in inputs or "sin" in inputs:
        return "positions"
    if "mask" in inputs:
        return "attention_mask"
    if "temperature" in inputs:
        return "temperature"
    if any(n in inputs for n in ("top_k", "top_p", "min_p")):
        return "truncation"
    return "unknown"


def _rerun(call: OpCall, r: KeyRows, t: KeyRows, rlog: CaptureLog, tcall: OpCall, f: Finding) -> None:
    """Re-run the rollout call holding the first differing row: own inputs, then swapped inputs
    with the rollout's and with the trainer's operator."""
    rb = get_backend(call.config) if call.config is not None else None
    tb = get_backend(tcall.config) if tcall.config is not None else None
    own = own_inputs(call)
    f.swap["reproducible"] = None if own is None else same_output(run_op(rb, call.op, own), call.output)
    swapped = swap_call(call, r, t, rlog)
    if swapped is None:
        f.swap["rollout_op_on_trainer_inputs"] = f.swap["trainer_op_on_trainer_inputs"] = None
        f.evidence.append("the rollout call could not be rebuilt from the trainer's rows (positions missing)")
        return
    want = trainer_rows(call, t, rlog)
    f.swap["rollout_op_on_trainer_inputs"] = same_output(run_op(rb, call.op, swapped), want)
    f.swap["trainer_op_on_trainer_inputs"] = same_output(run_op(tb, call.op, swapped), want)
    n = len(call.rows)
    shape = f"the rollout's call shape ({n} row{'s' if n != 1 else ''}, {f.phase})"
    verdict = {True: "equals the trainer's output", False: "still differs from the trainer's output"}
    f.evidence.append(f"swap inputs: the rollout's {call.op} ({call.backend}) re-run on the trainer's inputs in "
                      f"{shape} {verdict[bool(f.swap['rollout_op_on_trainer_inputs'])]}")
    f.evidence.append(f"control: the trainer's {call.op} ({tcall.backend}) on the same inputs in the same shape "
                      f"{verdict[bool(f.swap['trainer_op_on_trainer_inputs'])]}")
    if f.swap["reproducible"] is False:
        f.evidence.append(f"re-running the rollout's {call.op} on its own recorded inputs does not reproduce its "
                          "recorded output (non-deterministic operator)")


def classify(rlog: CaptureLog, tlog: CaptureLog) -> Finding:
    diffs, rows = compare_logs(rlog, tlog)
    f = Finding(diffs=diffs)
    first = next((d for d in diffs if d.divergent), None)
    if first is None:
        return f
    f.first = first
    r, t = rows[first.key]
    p0 = first.differing[0]
    _, ci, _ = r.where[p0]
    call, tcall = r.calls[ci], t.calls[t.where[p0][1]]
    f.phase = "prefill" if len(rlog.forwards[call.forward].positions) > 1 else "decode step"
    f.shapes = {"rollout": shapes(call), "trainer": shapes(tcall)}
    f.backends = {"rollout": call.config.fingerprint if call.config else call.backend,
                  "trainer": tcall.config.fingerprint if tcall.config else tcall.backend}
    f.evidence.append(f"first divergent operator: {_name(tcall)}: {len(first.differing)} of {first.compared} "
                      f"positions differ (first {p0}, in a rollout {f.phase}), max |diff| {first.max_abs_diff:.3g}; "
                      "every earlier operator is bitwise equal at every position")
    inputs = _input_diffs(first.op, r, t, first.differing, f.evidence)
    f.differing_inputs = sorted(inputs)
    if not inputs:
        f.evidence.append(f"all inputs of {first.op} are bitwise identical at the differing positions "
                          f"({', '.join(n for n in (*ROW_INPUTS[first.op], *PARAM_INPUTS.get(first.op, ())))})")
    _rerun(call, r, t, rlog, tcall, f)
    if inputs:
        f.klass, f.cause = "framework", _cause(first.op, inputs)
        confirmed = f.swap.get("rollout_op_on_trainer_inputs")
        note = {True: " (confirmed: on the trainer's inputs the rollout's operator gives the trainer's output)",
                False: " (the operator also differs on identical inputs)", None: ""}[confirmed]
        f.evidence.append(f"the operator's inputs already differ: the divergence enters before this operator{note}")
        return f
    rc, tc = call.config, tcall.config
    if (f.swap.get("trainer_op_on_trainer_inputs") and f.swap.get("rollout_op_on_trainer_inputs") is False
            and rc is not None and tc is not None and rc.backend == tc.backend and rc != tc):
        f.klass, f.cause = "framework", "kernel_config"
        changed = [k for k, v in rc.to_dict().items() if tc.to_dict()[k] != v]
        f.evidence.append(f"same backend ({rc.backend}) with different constants ({', '.join(changed)}): the "
                          "trainer's constants reproduce the trainer's output on the same inputs")
        return f
    f.klass, f.cause = "operator", "kernel"
    f.evidence.append(f"operator backends: rollout {f.backends['rollout']}, trainer {f.backends['trainer']}")
    if f.swap.get("trainer_op_on_trainer_inputs") is False:
        f.evidence.append(f"{first.op} is not invariant to the call shape (training forward vs {f.phase}) "
                          "on this machine")
    return f

