"""The consistency doctor: why do rollout and trainer logprobs of one sequence differ?

``diagnose`` replays one sequence (prompt + continuation) through the rollout path (the engine's
prefill and paged decode steps, teacher-forced) and the training path (the packed teacher-forced
forward), with every operator call captured (``capture.CapturingBackend``). It compares the cheap
framework facts of the two paths (weights checksum, dtype, kernel config, temperature, token ids,
positions), then finds the first operator whose outputs differ and classifies it by evidence
(``doctor_classify``): an **operator** fault (identical inputs, different outputs) or a
**framework** fault (the inputs already differ), with its cause. See docs/diagnosis.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from onpolicy.kernels import KernelConfig, get_backend, resolve_kernels
from onpolicy.kernels.truncation import NONE, Truncation

from .doctor_classify import classify
from .doctor_paths import Loader, PathOptions, PathRun, PathSetup, load_path_model, run_rollout, run_trainer
from .logdiff import LogdiffStats

CLASSES = ("none", "operator", "framework")
CAUSES = ("kernel", "weights", "dtype", "positions", "attention_mask", "temperature", "truncation", "tokenization",
          "kernel_config", "parallel_layout", "rng", "unknown")

ADVICE = {
    "kernel": "the operator itself computes differently on the two paths: run both with kernels=consistent, "
              "certify the backend on this machine (onpolicy selftest), and fix or replace the named operator",
    "weights": "the paths run different weights: sync the weight version (check sha256 and weight_version) "
               "before comparing; reload the rollout after every trainer step",
    "dtype": "the paths compute in different precisions: use one compute dtype (KernelConfig.compute_dtype)",
    "positions": "token positions differ (RoPE): check position ids, padding/offsets and BOS handling",
    "attention_mask": "the tokens attend to different positions: align masks (causal, padding, packing)",
    "temperature": "the trainer scores at a different temperature than the rollout sampled at: pass the "
                   "sampling temperature with every sample",
    "truncation": "the trainer scores a different top-k / top-p / min-p truncation than the rollout sampled "
                  "with (a truncated rollout scored untruncated is off-policy by construction): pass the "
                  "sample's top_k, top_p and min_p with every sample",
    "tokenization": "the token ids differ: train on the rollout's token ids, never re-tokenize decoded text",
    "kernel_config": "the same operators run with different constants (e.g. KV tile): deploy one KernelConfig "
                     "(the fingerprint) on both sides",
    "parallel_layout": "tensor/expert-parallel layouts differ without the canonical reduction order",
    "rng": "random state differs (sampling seeds, dropout): use per-request counter RNG, no dropout",
    "unknown": "inputs differ for a reason the doctor cannot name: inspect the evidence",
}


@dataclass
class Diagnosis:
    """The doctor's answer for one sequence (``to_dict`` is the ``--json`` output)."""

    model: str
    divergent: bool
    klass: str
    cause: str | None
    layer: int | None
    op: str | None
    module: str | None
    call_index: int | None
    position: int | None
    phase: str | None
    max_abs_logdiff: float
    first_token_index: int | None
    tokens: int
    mismatched_tokens: int
    prompt_tokens: int
    max_abs_op_diff: float
    ops_compared: int
    ops_divergent: int
    differing_inputs: list[str]
    shapes: dict[str, dict[str, list[int]]]
    backends: dict[str, str]
    facts: dict[str, dict[str, object]]
    evidence: list[str]
    swap: dict[str, bool | None]
    replay: dict[str, object] = field(default_factory=dict)
    advice: str = ""

    @property
    def summary(self) -> str:
        if not self.divergent:
            return f"no divergence: {self.tokens} tokens bitwise equal, every operator bitwise equal"
        where = f"layer {self.layer}" if self.layer is not None else (self.module or "?")
        return (f"{self.klass.upper()} fault ({self.cause}) at {self.op}, {where}; "
                f"max |logdiff| {self.max_abs_logdiff:.3g}")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (non-finite floats become None)."""
        d = asdict(self)
        d["class"] = d.pop("klass")
        d["summary"] = self.summary
        return _finite(d)  # type: ignore[return-value]

    def format(self) -> str:
        lines = [f"diagnosis of {self.model}: {self.prompt_tokens}-token prompt + {self.tokens} tokens",
                 f"  rollout: {self.facts['kernel_config']['rollout']}",
                 f"  trainer: {self.facts['kernel_config']['trainer']}"]
        diff = [k for k, v in self.facts.items() if v.get("differ")]
        lines.append(f"  framework facts that differ: {', '.join(diff) if diff else 'none'}")
        lines.append(f"  logprobs: {self.mismatched_tokens} of {self.tokens} tokens differ, max |logdiff| "
                     f"{self.max_abs_logdiff:.6g}"
                     + (f" (first at token {self.first_token_index})" if self.first_token_index is not None else ""))
        lines.append(f"  operators: {self.ops_divergent} of {self.ops_compared} differ")
        lines.append(f"verdict: {self.summary}")
        for e in self.evidence:
            lines.append(f"  - {e}")
        if self.advice:
            lines.append(f"what to do: {self.advice}")
        return "\n".join(lines)


def _finite(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


_FINGERPRINT = re.compile(r"^(?P<backend>.+)-r(?P<row>\d+)-kv(?P<kv>\d+)-(?P<dtype>fp32|bf16|fp16)-v\d+-[0-9a-f]{8}$")


def config_from_fingerprint(fingerprint: str | None) -> KernelConfig:
    """The kernel config a fingerprint names (backend mapped to one available here); the default
    consistent config when there is none or it cannot be parsed."""
    m = _FINGERPRINT.match(fingerprint or "")
    consistent = resolve_kernels("consistent")
    if not m:
        return KernelConfig(backend=consistent)
    try:
        backend = resolve_kernels(m["backend"])
    except ValueError:
        backend = consistent
    if backend == "ascend":
        backend = consistent  # "consistent" resolves to ascend only where it runs
    return KernelConfig(backend=backend, row_tile=int(m["row"]), kv_tile=int(m["kv"]),
                        compute_dtype=m["dtype"])  # type: ignore[arg-type]


def trainer_base(rollout_base: KernelConfig, trainer_kernel_config: Mapping[str, object] | None) -> KernelConfig:
    """The training path's default config: the one the verifier recorded, else the rollout's
    constants with the consistent backend."""
    consistent = resolve_kernels("consistent")
    if not trainer_kernel_config:
        return rollout_base.with_(backend=consistent)
    cfg = KernelConfig.from_dict(dict(trainer_kernel_config))
    try:
        backend = resolve_kernels(cfg.backend)
    except ValueError:
        backend = consistent
    return cfg.with_(backend=consistent if backend == "ascend" else backend)


def _setup(role: str, base: KernelConfig, opts: PathOptions, temperature: float, weights: str | None,
           tokenizer: str, truncation: Truncation = NONE) -> PathSetup:
    backend = resolve_kernels(opts.kernels) if opts.kernels else base.backend
    config = base.with_(backend=backend, compute_dtype=opts.dtype or base.compute_dtype,
                        kv_tile=opts.kv_tile or base.kv_tile)
    t = opts.temperature if opts.temperature is not None else temperature
    if role == "trainer" and not t > 0:
        raise ValueError("the trainer's temperature must be > 0")
    return PathSetup(role, config, float(t), opts.weights or weights, opts.position_offset,
                     opts.tokenizer or tokenizer, opts.max_batched_tokens or 2048, opts.mask_offset,
                     opts.truncation(truncation))


def _default_loader() -> Loader:
    from onpolicy.models.registry import load_model

    cache: dict[tuple[str, str], object] = {}

    def load(ref: str, dtype: str):  # type: ignore[no-untyped-def]
        if (ref, dtype) not in cache:
            cache[ref, dtype] = load_model(ref, get_backend(KernelConfig(compute_dtype=dtype)))  # type: ignore[arg-type]
        return cache[ref, dtype]

    return load  # type: ignore[return-value]


def _prompt_for(setup: PathSetup, lm: object, prompt: str | None, prompt_ids: list[int]) -> list[int]:
    if setup.tokenizer == "ids":
        return list(prompt_ids)
    tok = lm.tokenizer  # type: ignore[attr-defined]
    if tok is None:
        raise ValueError(f"tokenizer={setup.tokenizer} needs a model with a tokenizer")
    text = prompt if prompt is not None else tok.decode(list(prompt_ids))
    return tok.encode(tok.chat_prompt(text) if setup.tokenizer == "chat" else text)


def _facts(r: PathRun, t: PathRun) -> dict[str, dict[str, object]]:
    def fact(a: object, b: object, **extra: object) -> dict[str, object]:
        return {"rollout": a, "trainer": b, "differ": a != b, **extra}

    rc, tc = r.setup.config, t.setup.config
    return {
        # identity of the weights loaded (file checksum, or the model's own weights), whatever the dtype
        "weights": fact(r.weights_meta.get("file_sha256", "base"), t.weights_meta.get("file_sha256", "base"),
                        rollout_file=r.setup.weights, trainer_file=t.setup.weights,
                        rollout_version=r.weights_meta.get("version"), trainer_version=t.weights_meta.get("version"),
                        rollout_loaded_sha256=r.weights_sha256, trainer_loaded_sha256=t.weights_sha256),
        "dtype": fact(rc.compute_dtype, tc.compute_dtype),
        "kernel_config": fact(rc.fingerprint, tc.fingerprint, rollout_backend=rc.backend, trainer_backend=tc.backend),
        "temperature": fact(r.logprob_temperature, t.logprob_temperature),
        "truncation": fact(r.logprob_truncation.to_dict(), t.logprob_truncation.to_dict()),
        "tokenization": fact(r.prompt_ids, t.prompt_ids),
        "positions": fact(r.setup.position_offset, t.setup.position_offset),
        "attention_mask": fact(r.setup.mask_offset, t.setup.mask_offset),
    }


def diagnose(model: str, *, prompt_ids: Sequence[int] | None = None, prompt: str | None = None,
             token_ids: Sequence[int] | None = None, rollout: PathOptions | str | None = None,
             trainer: PathOptions | str | None = None, temperature: float | None = None,
             truncation: Truncation = NONE,
             kernel_fingerprint: str | None = None, trainer_kernel_config: Mapping[str, object] | None = None,
             weights_path: str | None = None,
             max_new_tokens: int = 16, seed: int = 0, recorded_logprobs: Sequence[float] | None = None,
             recorded_trainer_logprobs: Sequence[float] | None = None, loader: Loader | None = None) -> Diagnosis:
    """Replay one sequence through both paths and find where and why their logprobs diverge.

    ``prompt_ids`` (or ``prompt`` text, chat-templated) and the continuation ``token_ids`` (sampled
    by the rollout path with ``seed`` when None). ``temperature`` is both paths' default (the
    sample's; 0 = greedy sampling, scored at 1), ``truncation`` both paths' top-k / top-p / min-p
    (the sample's; none when greedy). ``rollout``/``trainer`` override each path
    (``PathOptions`` or its ``key=value,...`` text). ``kernel_fingerprint`` (the sample's) is the
    rollout's default kernel config; the trainer's is ``trainer_kernel_config`` (the verifier's),
    else the same constants with the consistent backend. ``weights_path`` is loaded over both
    paths' models. ``recorded_*logprobs`` (the sample's) are checked against the replays.
    ``loader(model, compute_dtype)`` supplies models (default: ``load_model``, cached per call).
    Raises ``ValueError`` on bad input."""
    if prompt_ids is None and prompt is None:
        raise ValueError("give prompt_ids or a prompt text")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise ValueError("temperature must be a finite number >= 0")
    if weights_path is not None and not Path(weights_path).is_file():
        raise ValueError(f"weights file {weights_path} does not exist")
    ropts = rollout if isinstance(rollout, PathOptions) else PathOptions.parse(rollout)
    topts = trainer if isinstance(trainer, PathOptions) else PathOptions.parse(trainer)
    for o in (ropts, topts):
        if o.weights and not Path(o.weights).is_file():
            raise ValueError(f"weights file {o.weights} does not exist")
    base = config_from_fingerprint(kernel_fingerprint)
    tbase = trainer_base(base, trainer_kernel_config)
    mode = "ids" if prompt_ids is not None else "chat"
    temp = temperature if temperature is not None else 1.0
    rs = _setup("rollout", base, ropts, temp, weights_path, mode, truncation)
    ts = _setup("trainer", tbase, topts, temp if temp > 0 else 1.0, weights_path, mode,  # greedy: scored at 1,
                truncation if temp > 0 else NONE)  # untruncated
    load = loader or _default_loader()
    rlm, rsha, rmeta = load_path_model(load, model, rs)
    tlm, tsha, tmeta = load_path_model(load, model, ts)
    vocab = rlm.config.vocab_size
    if prompt_ids is None:
        assert prompt is not None
        if rlm.tokenizer is None:
            raise ValueError(f"model {model} has no tokenizer: give prompt_ids")
        prompt_ids = rlm.tokenizer.encode(rlm.tokenizer.chat_prompt(prompt))
    canonical = [int(t) for t in prompt_ids]
    r_prompt, t_prompt = _prompt_for(rs, rlm, prompt, canonical), _prompt_for(ts, tlm, prompt, canonical)
    forced = None if token_ids is None else [int(t) for t in token_ids]
    for name, ids in (("prompt", r_prompt), ("prompt", t_prompt), ("continuation", forced or [])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if not r_prompt or not t_prompt or forced == []:
        raise ValueError("prompt and continuation must not be empty")
    longest = max(len(r_prompt), len(t_prompt)) + (len(forced) if forced else max_new_tokens)
    limit = rlm.config.max_position_embeddings - max(rs.position_offset, ts.position_offset)
    if longest > limit:
        raise ValueError(f"{longest} positions exceed the model's {limit}")
    rlog, tokens, rlp = run_rollout(rlm, rs, r_prompt, forced, max_new_tokens, seed)
    tlog, tlp = run_trainer(tlm, ts, t_prompt, tokens)
    r_run = PathRun(rs, rlog, r_prompt, tokens, rlp, rsha, rmeta)
    t_run = PathRun(ts, tlog, t_prompt, tokens, tlp, tsha, tmeta)
    stats = LogdiffStats()
    a, b = torch.tensor(rlp, dtype=torch.float32), torch.tensor(tlp, dtype=torch.float32)
    stats.add(a, b)
    neq = (a != b).nonzero()
    f = classify(rlog, tlog)
    first = f.first
    divergent = first is not None or stats.mismatched_tokens > 0
    facts = _facts(r_run, t_run)
    evidence = [f"framework facts that differ: {', '.join(k for k, v in facts.items() if v['differ']) or 'none'}",
                *f.evidence]
    if first is not None and stats.mismatched_tokens == 0:
        evidence.append("the operator divergence did not reach this sequence's token logprobs (bitwise equal "
                        "after rounding); other sequences will show it")
    if not divergent and any(v["differ"] for v in facts.values()):
        evidence.append("the paths are set up differently, yet every operator and logprob is bitwise equal "
                        "for this sequence")
    replay: dict[str, object] = {}
    for role, recorded, replayed in (("rollout", recorded_logprobs, a), ("trainer", recorded_trainer_logprobs, b)):
        if recorded is None or len(recorded) != len(tokens):
            continue
        rec = torch.tensor([float(x) for x in recorded], dtype=torch.float32)
        same = bool(torch.equal(rec, replayed))
        gap = float((rec - replayed).abs().max()) if len(tokens) else 0.0
        replay[f"{role}_matches_sample"], replay[f"{role}_max_abs_diff_to_sample"] = same, gap
        if not same:
            evidence.append(f"the {role} replay does not reproduce the sample's recorded {role} logprobs (max |diff| "
                            f"{gap:.3g}): the sample was produced under other settings, or in a batch with kernels "
                            "that are not batch-invariant")
    klass = f.klass if divergent else "none"
    cause = f.cause if divergent else None
    if divergent and first is None:  # cannot happen while every logprob comes from a captured operator
        klass, cause = "framework", "unknown"
    return Diagnosis(
        model=model, divergent=divergent, klass=klass, cause=cause,
        layer=first.layer if first else None, op=first.op if first else None,
        module=first.key[0] if first else None, call_index=first.key[2] if first else None,
        position=first.differing[0] if first else None, phase=f.phase,
        max_abs_logdiff=stats.max_abs_logdiff, first_token_index=int(neq[0]) if len(neq) else None,
        tokens=len(tokens), mismatched_tokens=stats.mismatched_tokens, prompt_tokens=len(r_prompt),
        max_abs_op_diff=first.max_abs_diff if first else 0.0, ops_compared=len(f.diffs),
        ops_divergent=sum(d.divergent for d in f.diffs), differing_inputs=f.differing_inputs,
        shapes=f.shapes, backends=f.backends or {"rollout": rs.config.fingerprint, "trainer": ts.config.fingerprint},
        facts=facts, evidence=evidence, swap=f.swap, replay=replay, advice=ADVICE.get(cause or "", ""),
    )


SAMPLE_KEYS = ("model", "kernel_fingerprint", "weight_version", "weights_path", "prompt_ids", "token_ids",
               "logprobs", "trainer_logprobs", "temperature", "top_k", "top_p", "min_p", "source", "job_id", "step",
               "max_abs_logdiff",
               "first_mismatch_index")


def _ids(obj: Mapping[str, object], key: str, source: str) -> list[int]:
    v = obj.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ValueError(f"{source}: {key} must be a non-empty list of integers")
    return list(v)


def _floats(obj: Mapping[str, object], key: str, n: int, source: str) -> list[float] | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                                         for x in v):
        raise ValueError(f"{source}: {key} must be a list of numbers, one per token id")
    return [float(x) for x in v]


def _truncation(sample: Mapping[str, object], source: str) -> Truncation:
    """A sample's ``top_k`` / ``top_p`` / ``min_p`` (absent: off)."""
    values = {k: sample[k] for k in ("top_k", "top_p", "min_p") if sample.get(k) is not None}
    try:
        return Truncation(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def diagnose_sample(sample: Mapping[str, object], *, model: str | None = None, index: int = 0,
                    rollout: PathOptions | str | None = None, trainer: PathOptions | str | None = None,
                    loader: Loader | None = None, source: str = "sample") -> Diagnosis:
    """Diagnose a mismatch-store sample (``SAMPLE_KEYS``) or an ``onpolicy generate --json`` output
    (its ``completions[index]``, or one completion object with ``model`` given)."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"{source}: expected a JSON object")
    top: Mapping[str, object] = sample
    if "completions" in sample:
        comps = sample["completions"]
        if not isinstance(comps, list) or not comps:
            raise ValueError(f"{source}: completions must be a non-empty list")
        if not 0 <= index < len(comps):
            raise ValueError(f"{source}: no completion {index} (it has {len(comps)})")
        sample = comps[index]
        if not isinstance(sample, Mapping):
            raise ValueError(f"{source}: completion {index} is not an object")
    model = model or top.get("model") or sample.get("model")  # type: ignore[assignment]
    if not isinstance(model, str) or not model:
        raise ValueError(f"{source}: no model named (give --model)")
    prompt_ids, token_ids = _ids(sample, "prompt_ids", source), _ids(sample, "token_ids", source)
    temperature = sample.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"{source}: temperature must be a number")
    recorded = {key: _floats(sample, key, len(token_ids), source) for key in ("logprobs", "trainer_logprobs")}
    truncation = _truncation(sample, source)
    fingerprint = sample.get("kernel_fingerprint", top.get("kernel_fingerprint"))
    tconfig = sample.get("trainer_kernel_config")
    if tconfig is not None and not isinstance(tconfig, Mapping):
        raise ValueError(f"{source}: trainer_kernel_config must be an object")
    weights_path = sample.get("weights_path")
    return diagnose(model, prompt_ids=prompt_ids, token_ids=token_ids, rollout=rollout, trainer=trainer,
                    temperature=float(temperature), truncation=truncation,
                    kernel_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
                    trainer_kernel_config=tconfig or None,
                    weights_path=weights_path if isinstance(weights_path, str) and weights_path else None,
                    recorded_logprobs=recorded["logprobs"], recorded_trainer_logprobs=recorded["trainer_logprobs"],
                    loader=loader)
