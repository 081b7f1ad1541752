"""Validation and conversion of TrainerService requests into the engine's domain types.

Every refusal is an ``InvalidArgument`` naming the offending field by its path in the request
(``samples[2].old_logprobs``, ``loss.clip_eps_low``, ``optimizer.lr`` ...). proto3 cannot tell an
unset scalar from 0, so a few zeros mean "unset": a temperature of 0 means 1.0 (the rollout reports
greedy logprobs at temperature 1), ``epochs`` / ``minibatches`` of 0 mean 1, ``pack_tokens`` of 0
means the engine default, an empty ``kl_estimator`` means ``k3``, empty ``extra_json`` means ``{}``,
and a ``top_p`` of 0 means 1 (``top_k`` / ``min_p`` of 0 are off anyway).
Everything else must be given explicitly (an AdamW ``eps`` of 0 is refused, not defaulted).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from onpolicy.kernels.truncation import Truncation
from onpolicy.models.config import ModelConfig
from onpolicy.services.api import common_pb2, trainer_pb2
from onpolicy.services.common.errors import InvalidArgument
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainSample
from onpolicy.trainer.correction import CORRECTION_LEVELS, CORRECTION_MODES
from onpolicy.trainer.forward import ScoredSequence
from onpolicy.trainer.grpo import KL_ESTIMATORS, LOSS_AGGS, RATIO_LEVELS


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value}")
    return float(value)


def _ids(field: str, ids: Sequence[int], vocab: int) -> tuple[int, ...]:
    if not ids:
        raise InvalidArgument(field, "must not be empty")
    for j, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(field, f"token id {t} at index {j} is outside the vocabulary [0, {vocab})")
    return tuple(ids)


def _temperature(field: str, value: float) -> float:
    value = _finite(field, value)
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0 (0 = unset, i.e. 1.0), got {value}")
    return value or 1.0


def _truncation(field: str, msg: trainer_pb2.TrainSample | common_pb2.ScoredSequence) -> Truncation:
    """A message's top_k / top_p / min_p (proto3 zeros: off)."""
    try:
        return Truncation.from_proto(msg.top_k, msg.top_p, msg.min_p)
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def _sequence(field: str, msg: trainer_pb2.TrainSample | common_pb2.ScoredSequence,
              cfg: ModelConfig) -> ScoredSequence:
    trunc = _truncation(field, msg)
    seq = ScoredSequence(_ids(f"{field}.prompt_ids", msg.prompt_ids, cfg.vocab_size),
                         _ids(f"{field}.token_ids", msg.token_ids, cfg.vocab_size),
                         _temperature(f"{field}.temperature", msg.temperature), **trunc.to_dict())
    if seq.input_len > cfg.max_position_embeddings:
        raise InvalidArgument(field, f"prompt + tokens need {seq.input_len} positions, the model has "
                                     f"{cfg.max_position_embeddings}")
    return seq


def scored_sequences(request: trainer_pb2.ComputeLogprobsRequest, cfg: ModelConfig) -> list[ScoredSequence]:
    if not request.sequences:
        raise InvalidArgument("sequences", "must not be empty")
    if request.pack_tokens < 0:
        raise InvalidArgument("pack_tokens", f"must be >= 0 (0 = default), got {request.pack_tokens}")
    return [_sequence(f"sequences[{i}]", s, cfg) for i, s in enumerate(request.sequences)]


def train_samples(samples: Sequence[trainer_pb2.TrainSample], cfg: ModelConfig) -> list[TrainSample]:
    if not samples:
        raise InvalidArgument("samples", "must not be empty")
    out = []
    for i, s in enumerate(samples):
        f = f"samples[{i}]"
        seq = _sequence(f, s, cfg)
        if len(s.old_logprobs) != len(s.token_ids):
            raise InvalidArgument(f"{f}.old_logprobs", f"has {len(s.old_logprobs)} values; token_ids has "
                                                       f"{len(s.token_ids)} (one logprob per token)")
        bad = [x for x in s.old_logprobs if not math.isfinite(x)]
        if bad:
            raise InvalidArgument(f"{f}.old_logprobs", f"must be finite, got {bad[0]}")
        out.append(TrainSample(prompt_ids=seq.prompt_ids, token_ids=seq.token_ids,
                               old_logprobs=tuple(s.old_logprobs), advantage=_finite(f"{f}.advantage", s.advantage),
                               temperature=seq.temperature, **seq.truncation.to_dict()))
    return out


def loss_config(msg: trainer_pb2.LossConfig, num_samples: int, field: str = "loss") -> LossConfig:
    low = _finite(f"{field}.clip_eps_low", msg.clip_eps_low)
    if not 0 <= low < 1:
        raise InvalidArgument(f"{field}.clip_eps_low", f"must be in [0, 1), got {low}")
    high = _finite(f"{field}.clip_eps_high", msg.clip_eps_high)
    if high < 0:
        raise InvalidArgument(f"{field}.clip_eps_high", f"must be >= 0, got {high}")
    kl_coef = _finite(f"{field}.kl_coef", msg.kl_coef)
    if kl_coef < 0:
        raise InvalidArgument(f"{field}.kl_coef", f"must be >= 0, got {kl_coef}")
    estimator = msg.kl_estimator or "k3"
    if estimator not in KL_ESTIMATORS:
        raise InvalidArgument(f"{field}.kl_estimator", f"must be one of {', '.join(KL_ESTIMATORS)}, got "
                                                       f"{msg.kl_estimator!r}")
    if msg.loss_agg not in LOSS_AGGS:
        raise InvalidArgument(f"{field}.loss_agg", f"must be one of {', '.join(LOSS_AGGS)}, got {msg.loss_agg!r}")
    for name in ("epochs", "minibatches"):
        if getattr(msg, name) < 0:
            raise InvalidArgument(f"{field}.{name}", f"must be >= 1 (0 = unset, i.e. 1), got {getattr(msg, name)}")
    minibatches = msg.minibatches or 1
    if minibatches > num_samples:
        raise InvalidArgument(f"{field}.minibatches", f"{minibatches} minibatches need at least as many samples, "
                                                      f"got {num_samples}")
    return LossConfig(clip_eps_low=low, clip_eps_high=high, kl_coef=kl_coef, kl_estimator=estimator,
                      loss_agg=msg.loss_agg, epochs=msg.epochs or 1, minibatches=minibatches,
                      **_algorithm_fields(msg, field))


def _choice(field: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidArgument(field, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _algorithm_fields(msg: trainer_pb2.LossConfig, field: str) -> dict[str, object]:
    """The ratio level, Dr. GRPO horizon, entropy coefficient and rollout correction of ``msg``
    (empty strings mean the first choice, a threshold of 0 means 2)."""
    level = _choice(f"{field}.ratio_level", msg.ratio_level or "token", RATIO_LEVELS)
    if msg.loss_agg == "seq-mean-token-sum-norm" and msg.horizon < 1:
        raise InvalidArgument(f"{field}.horizon", f"must be >= 1 with loss_agg seq-mean-token-sum-norm, got "
                                                  f"{msg.horizon}")
    entropy_coef = _finite(f"{field}.entropy_coef", msg.entropy_coef)
    if entropy_coef < 0:
        raise InvalidArgument(f"{field}.entropy_coef", f"must be >= 0, got {entropy_coef}")
    threshold = _finite(f"{field}.correction_threshold", msg.correction_threshold) or 2.0
    if threshold < 1:
        raise InvalidArgument(f"{field}.correction_threshold", f"must be >= 1 (0 = unset, i.e. 2), got {threshold}")
    return {"ratio_level": level, "horizon": max(msg.horizon, 0), "entropy_coef": entropy_coef,
            "correction_mode": _choice(f"{field}.correction_mode", msg.correction_mode or "none", CORRECTION_MODES),
            "correction_level": _choice(f"{field}.correction_level", msg.correction_level or "token",
                                        CORRECTION_LEVELS),
            "correction_threshold": threshold}


def optimizer_config(msg: trainer_pb2.OptimizerConfig, field: str = "optimizer") -> OptimizerConfig:
    v = {name: _finite(f"{field}.{name}", getattr(msg, name))
         for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip")}
    if v["lr"] <= 0:
        raise InvalidArgument(f"{field}.lr", f"must be > 0, got {v['lr']}")
    for name in ("beta1", "beta2"):
        if not 0 <= v[name] < 1:
            raise InvalidArgument(f"{field}.{name}", f"must be in [0, 1), got {v[name]}")
    if v["eps"] <= 0:
        raise InvalidArgument(f"{field}.eps", f"must be > 0, got {v['eps']}")
    for name in ("weight_decay", "grad_clip"):
        if v[name] < 0:
            raise InvalidArgument(f"{field}.{name}", f"must be >= 0, got {v[name]}")
    return OptimizerConfig(**v)


def keep_last(value: int) -> int:
    if value < 0:
        raise InvalidArgument("keep_last", f"must be >= 0 (0 keeps every version), got {value}")
    return value


def directory(value: str, field: str = "directory") -> str:
    if not value:
        raise InvalidArgument(field, "must name a directory")
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")
    return value


def extra_json(value: str, field: str = "extra_json") -> str:
    if not value:
        return "{}"
    try:
        json.loads(value)
    except ValueError as e:
        raise InvalidArgument(field, f"must be valid JSON ({e})") from None
    return value


def logprobs_to_proto(lps: Sequence[Sequence[float]]) -> list[trainer_pb2.TokenLogprobs]:
    """fp32 values travel bit for bit in the proto's ``float``."""
    return [trainer_pb2.TokenLogprobs(logprobs=list(lp)) for lp in lps]

