"""The two paths the doctor replays one sequence through, each under per-operator capture.

* **rollout**: the real ``RolloutEngine`` step loop (scheduler, block manager, paged KV cache:
  prefill, then one paged decode step per token). Its model runner is the engine's own
  ``ModelRunner`` with one change made from outside: after sampling, the known continuation token is
  fed back instead of the sampled one (teacher forcing through the decode steps), with its logprob
  read from the same log-softmax row.
* **trainer**: ``onpolicy.trainer.forward.sequence_logprobs`` — the packed teacher-forced forward.

Both run the model through a thin stand-in (``_Tap``) that marks forward boundaries for the capture
log, passes the path's ``CapturingBackend`` as ``ops`` and applies the injected faults that live
outside the operators (a position offset, an off-by-one attention mask). Nothing in the model, the
engine or the trainer changes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
from safetensors import safe_open
from torch import Tensor

from onpolicy.kernels import KernelConfig, KVSource, get_backend
from onpolicy.kernels.truncation import NONE, RowTruncation, Truncation
from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.config import ModelConfig
from onpolicy.models.context import AttentionContext
from onpolicy.models.loading import LoadedModel, ModelLoadError, copy_weights_, weights_sha256
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.rollout.model_runner import ModelRunner, SampledToken
from onpolicy.rollout.scheduler import SchedulerOutput
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs
from onpolicy.weights import file_sha256

from .capture import CaptureLog, CapturingBackend, capture_modules

#: ``loader(model_ref, compute_dtype)`` -> a model in that dtype (never mutated by the doctor).
Loader = Callable[[str, str], LoadedModel]

TOKENIZER_MODES = ("ids", "chat", "raw")


@dataclass(frozen=True, kw_only=True)
class PathOptions:
    """Per-path overrides (``--rollout`` / ``--trainer`` ``key=value,...``); None = the default."""

    kernels: str | None = None
    """``consistent`` | ``fast`` | a backend name."""
    dtype: str | None = None
    """Compute dtype: ``fp32`` | ``bf16``."""
    temperature: float | None = None
    """Logprob temperature (rollout: also the sampling temperature; 0 = greedy, logprobs at 1)."""
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    """Truncation (rollout: sampling and reported logprobs; trainer: the distribution scored)."""
    kv_tile: int | None = None
    weights: str | None = None
    """A safetensors weights file (e.g. from ``onpolicy.weights.export_weights``) loaded over the model."""
    position_offset: int = 0
    """Hidden, for fault injection: added to every RoPE position of this path."""
    mask_offset: int = 0
    """Hidden, for fault injection: every query attends to ``mask_offset`` fewer positions (an
    off-by-one causal mask; position 0 still sees itself)."""
    tokenizer: str | None = None
    """Hidden, for fault injection: ``ids`` (use the prompt ids as given), ``chat`` / ``raw`` (re-encode
    the prompt text with / without the chat template)."""
    max_batched_tokens: int | None = None
    """Rollout only: token rows per engine step (a smaller value chunks the prefill)."""

    @classmethod
    def parse(cls, text: str | None) -> PathOptions:
        """``key=value[,key=value...]``; raises ``ValueError`` naming the bad key or value."""
        values: dict[str, object] = {}
        names = {f.name for f in fields(cls)}
        for item in (text or "").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"expected key=value, got {item!r}")
            if key not in names:
                raise ValueError(f"unknown key {key!r}; expected one of {sorted(names)}")
            try:
                if key in ("temperature", "top_p", "min_p"):
                    values[key] = float(value)
                elif key in ("kv_tile", "position_offset", "mask_offset", "max_batched_tokens", "top_k"):
                    values[key] = int(value)
                else:
                    values[key] = value
            except ValueError:
                raise ValueError(f"{key}: bad value {value!r}") from None
        return cls(**values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        t = self.temperature
        if t is not None and (not math.isfinite(t) or t < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if self.dtype is not None and self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.tokenizer is not None and self.tokenizer not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer must be one of {list(TOKENIZER_MODES)}, got {self.tokenizer!r}")
        if self.position_offset < 0 or self.mask_offset < 0:
            raise ValueError("position_offset and mask_offset must be >= 0")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        Truncation(top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                   min_p=self.min_p or 0.0)  # validates

    def truncation(self, default: Truncation) -> Truncation:
        """``default`` with this path's overrides."""
        return Truncation(top_k=default.top_k if self.top_k is None else self.top_k,
                          top_p=default.top_p if self.top_p is None else self.top_p,
                          min_p=default.min_p if self.min_p is None else self.min_p)


@dataclass(frozen=True)
class PathSetup:
    """One path, resolved: its kernel config and the framework settings it runs with."""

    role: str
    config: KernelConfig
    temperature: float
    weights: str | None = None
    position_offset: int = 0
    tokenizer: str = "ids"
    max_batched_tokens: int = 2048
    mask_offset: int = 0
    truncation: Truncation = NONE


@dataclass
class PathRun:
    """What one path computed, with its capture log."""

    setup: PathSetup
    log: CaptureLog
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weights_sha256: str
    weights_meta: dict[str, str] = field(default_factory=dict)

    @property
    def logprob_temperature(self) -> float:
        return self.setup.temperature if self.setup.temperature > 0 else 1.0

    @property
    def logprob_truncation(self) -> Truncation:
        """The truncation of the logprobs this path computed (none for greedy sampling)."""
        return self.setup.truncation if self.setup.temperature > 0 else NONE


class _MaskedContext:
    """An attention context whose queries attend to ``offset`` fewer positions (fault injection)."""

    def __init__(self, ctx: AttentionContext, offset: int) -> None:
        b = ctx.batch
        self.ctx = ctx
        self.batch = replace(b, q_pos=(b.q_pos - offset).clamp(min=0))

    def kv(self, layer: int, k: Tensor, v: Tensor) -> KVSource:
        return self.ctx.kv(layer, k, v)


class _Tap:
    """Stands in for ``CausalLM`` in the engine's model runner and in the trainer's forward."""

    def __init__(self, model: CausalLM, ops: CapturingBackend, setup: PathSetup,
                 lm_rows: Callable[[int, int], Tensor], label: str) -> None:
        self.model, self.ops, self.lm_rows, self.label = model, ops, lm_rows, label
        self.offset, self.mask_offset = setup.position_offset, setup.mask_offset
        self.forward_rows = 0
        self.last_lp: Tensor | None = None

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def dense_stack(self) -> None:
        """No one-call decoder for the engine: every operator runs (and is captured) on its own."""
        return None

    def hidden(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, ops: object = None,
               stack: object = None) -> Tensor:
        """The model's forward, operator by operator (``stack`` is None: see ``dense_stack``)."""
        self.ops.log.begin_forward(positions, self.label)
        self.forward_rows = int(positions.numel())
        if self.mask_offset:
            ctx = _MaskedContext(ctx, self.mask_offset)
        return self.model.hidden(input_ids, positions + self.offset, ctx, self.ops)

    def logprobs(self, hidden: Tensor, temperature: Tensor, ops: object = None,
                 truncation: RowTruncation | None = None) -> Tensor:
        with self.ops.log.scope("lm_head", self.lm_rows(self.forward_rows, int(hidden.shape[0]))):
            self.last_lp = self.model.logprobs(hidden, temperature, self.ops, truncation)
        return self.last_lp

    def token_logprobs(self, hidden: Tensor, temperature: Tensor, targets: Tensor, ops: object = None,
                       truncation: RowTruncation | None = None) -> Tensor:
        with self.ops.log.scope("lm_head", self.lm_rows(self.forward_rows, int(hidden.shape[0]))):
            return self.model.token_logprobs(hidden, temperature, targets, self.ops, truncation)


class _ForcedRunner(ModelRunner):
    """The engine's model runner, teacher-forced: the known next token replaces the sampled one."""

    def __init__(self, tap: _Tap, cache: object, forced: list[int] | None) -> None:
        super().__init__(tap, cache)  # type: ignore[arg-type]
        self.tap, self.forced = tap, forced

    def run(self, out: SchedulerOutput) -> list[SampledToken]:
        sampled = super().run(out)
        if self.forced is None:
            return sampled
        seqs = {s.seq.seq_id: s.seq for s in out.scheduled}
        assert self.tap.last_lp is not None or not sampled
        forced = []
        for j, tok in enumerate(sampled):
            t = self.forced[len(seqs[tok.seq_id].generated)]
            forced.append(SampledToken(tok.seq_id, t, float(self.tap.last_lp[j, t])))  # type: ignore[index]
        return forced


def load_path_model(loader: Loader, ref: str, setup: PathSetup) -> tuple[LoadedModel, str, dict[str, str]]:
    """The path's model (a private copy when a weights file is loaded over it), its weights
    sha256 and the weights file's metadata."""
    lm = loader(ref, setup.config.compute_dtype)
    if not setup.weights:
        return lm, lm.weights_sha256, {}
    try:
        with safe_open(setup.weights, "pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    except Exception as e:  # safetensors raises its own error types on malformed files
        raise ValueError(f"{setup.weights}: unreadable weights file ({str(e).splitlines()[0]})") from e
    model = copy.deepcopy(lm.model)
    try:
        copy_weights_(model, state)
    except ModelLoadError as e:
        raise ValueError(f"{setup.weights}: {e}") from e
    meta["file_sha256"] = file_sha256(setup.weights)
    return LoadedModel(lm.name, model, lm.tokenizer, lm.weights_sha256), weights_sha256(model.state_dict()), meta


def run_rollout(lm: LoadedModel, setup: PathSetup, prompt_ids: list[int], forced: list[int] | None,
                max_new_tokens: int, seed: int) -> tuple[CaptureLog, list[int], list[float]]:
    """Prefill + paged decode of ``prompt_ids`` in the rollout engine, teacher-forced through
    ``forced`` (or sampling ``max_new_tokens`` with ``seed`` when None)."""
    log = CaptureLog()
    ops = CapturingBackend(get_backend(setup.config), log)
    tap = _Tap(lm.model, ops, setup, lambda n, k: torch.arange(n - k, n), "rollout")
    n = len(forced) if forced is not None else max_new_tokens
    params = SamplingParams(temperature=setup.temperature, max_new_tokens=n, ignore_eos=forced is not None,
                            seed=seed, **setup.truncation.to_dict())
    page = setup.config.kv_tile
    tokens = (-(-(len(prompt_ids) + n) // page) + 1) * page
    engine = RolloutEngine(LoadedModel(lm.name, tap, lm.tokenizer, lm.weights_sha256),  # type: ignore[arg-type]
                           EngineConfig(max_num_seqs=1, max_batched_tokens=setup.max_batched_tokens,
                                        kv_cache_tokens=tokens, prefix_cache=False))
    engine.runner = _ForcedRunner(tap, engine.cache, forced)
    with torch.no_grad(), capture_modules(lm.model, log):
        (completion,) = engine.generate([prompt_ids], params)
    return log, list(completion.token_ids), list(completion.logprobs)


def run_trainer(lm: LoadedModel, setup: PathSetup, prompt_ids: list[int], token_ids: list[int],
                ) -> tuple[CaptureLog, list[float]]:
    """The training path's packed teacher-forced forward over prompt + continuation."""
    log = CaptureLog()
    ops = CapturingBackend(get_backend(setup.config), log)
    first = len(prompt_ids) - 1
    tap = _Tap(lm.model, ops, setup, lambda n, k: torch.arange(first, first + k), "trainer")
    seq = ScoredSequence(tuple(prompt_ids), tuple(token_ids), setup.temperature if setup.temperature > 0 else 1.0,
                         **setup.truncation.to_dict())
    with torch.no_grad(), capture_modules(lm.model, log):
        (lp,) = sequence_logprobs(tap, [seq])  # type: ignore[arg-type]
    return log, [float(x) for x in lp.tolist()]

