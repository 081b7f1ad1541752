"""The trainer's typed boundary: engine settings, one training sample, loss and optimizer settings
of a step, and the statistics a step returns. Every config validates itself on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .correction import CORRECTION_LEVELS, CORRECTION_MODES, CorrectionStats
from .forward import ScoredSequence
from .grpo import KL_ESTIMATORS, LOSS_AGGS, RATIO_LEVELS


def _finite(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    pack_tokens: int = 4096
    """Most token rows in one packed forward (a microbatch); a minibatch is packed greedily in order."""
    seed: int = 0
    """Seed of the engine's own RNG (saved and restored with checkpoints)."""
    deterministic: bool = True
    """Run train steps under ``torch.use_deterministic_algorithms(True, warn_only=True)``."""

    def __post_init__(self) -> None:
        if self.pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1, got {self.pack_tokens}")


@dataclass(frozen=True, kw_only=True)
class TrainSample:
    """One completion to learn from, with the fp32 logprobs the rollout sampled it with."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    """The truncation the rollout sampled with (off: 0, 1, 0): the trainer scores the same distribution."""

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.token_ids:
            raise ValueError("prompt_ids and token_ids must not be empty")
        if len(self.old_logprobs) != len(self.token_ids):
            raise ValueError(f"old_logprobs has {len(self.old_logprobs)} values for {len(self.token_ids)} tokens")
        if not all(math.isfinite(x) for x in self.old_logprobs):
            raise ValueError("old_logprobs must be finite")
        _finite("advantage", self.advantage)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")

    @property
    def scored(self) -> ScoredSequence:
        return ScoredSequence(tuple(self.prompt_ids), tuple(self.token_ids), float(self.temperature),
                              top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    clip_eps_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_eps_low``; in [0, 1)."""
    clip_eps_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_eps_high`` (DAPO's clip-higher uses e.g. 0.28)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy (the initial weights); 0 = none."""
    kl_estimator: str = "k3"
    """``k1`` (lp - ref) or ``k3`` (exp(ref - lp) - (ref - lp) - 1)."""
    loss_agg: str = "token-mean"
    """``token-mean`` (every token weighs the same), ``seq-mean`` (every sequence does) or
    ``seq-mean-token-sum-norm`` (token sums divided by ``horizon``: no length normalisation)."""
    epochs: int = 1
    """Passes over the samples in one step."""
    minibatches: int = 1
    """Optimizer updates per epoch; the samples are split in order into this many contiguous parts."""
    ratio_level: str = "token"
    """``token``: a ratio per token (GRPO, DAPO, Dr. GRPO); ``sequence``: the geometric mean of a
    sequence's token ratios, clipped per sequence (GSPO)."""
    horizon: int = 0
    """The constant divisor per sequence of ``seq-mean-token-sum-norm`` (the rollout's max_new_tokens)."""
    entropy_coef: float = 0.0
    """The loss is reduced by this times the token-mean entropy of the current policy; 0 = none."""
    correction_mode: str = "none"
    """Rollout correction (``onpolicy.trainer.correction``): ``none``, ``tis`` or ``mis``; any but
    ``none`` makes the step recompute the old logprobs on the trainer."""
    correction_level: str = "token"
    """``token`` or ``sequence``: the importance weight per token or per sequence."""
    correction_threshold: float = 2.0
    """TIS truncates the weight here; MIS masks weights above it; >= 1."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef", "correction_threshold"):
            _finite(name, getattr(self, name))
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {list(RATIO_LEVELS)}, got {self.ratio_level!r}")
        if self.loss_agg == "seq-mean-token-sum-norm" and self.horizon < 1:
            raise ValueError(f"loss_agg seq-mean-token-sum-norm needs horizon >= 1, got {self.horizon}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.correction_mode not in CORRECTION_MODES:
            raise ValueError(f"correction_mode must be one of {list(CORRECTION_MODES)}, got {self.correction_mode!r}")
        if self.correction_level not in CORRECTION_LEVELS:
            raise ValueError(f"correction_level must be one of {list(CORRECTION_LEVELS)}, "
                             f"got {self.correction_level!r}")
        if self.correction_threshold < 1:
            raise ValueError(f"correction_threshold must be >= 1, got {self.correction_threshold}")
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {list(LOSS_AGGS)}, got {self.loss_agg!r}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"epochs and minibatches must be >= 1, got {self.epochs}, {self.minibatches}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyperparameters; the optimizer is created from the first step's and updated each step."""

    lr: float = 1e-6
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    """Max global gradient L2 norm; 0 = no clipping (the norm is still reported)."""

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"):
            _finite(name, getattr(self, name))
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got {self.weight_decay}, {self.grad_clip}")


@dataclass(frozen=True)
class StepStats:
    step: int
    """The step counter after this step (= the version of weights it produced)."""
    loss: float
    """Mean over the step's optimizer updates of the minibatch loss."""
    grad_norm: float
    """Mean over updates of the global gradient norm before clipping."""
    clip_fraction: float
    kl: float
    """Token-mean KL estimate against the reference policy (0 when ``kl_coef`` is 0)."""
    approx_kl: float
    """Token-mean k3 estimate of KL(old ‖ new) over every forward of the step."""
    tokens: int
    """Continuation tokens in the step's samples."""
    seconds: float
    """Wall time of the whole step, the recompute pass included."""
    tokens_per_second: float
    old_logprob_max_abs_diff: float
    """Max |old - trainer| logprob over the forward passes before the first update (all samples with
    ``recompute_old``; the first minibatch otherwise). 0 means bitwise on-policy."""
    recompute_seconds: float
    updates: int
    entropy: float = 0.0
    """Token-mean entropy of the policy on the sampled positions over every forward of the step."""
    correction: CorrectionStats = field(default_factory=CorrectionStats)
    """The rollout-correction weights of the step (empty unless ``correction_mode`` is not ``none``)."""
