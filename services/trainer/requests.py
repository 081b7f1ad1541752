"""Validation and conversion of TrainerService requests into the engine's domain types.

Every refusal is an ``InvalidArgument`` naming the offending field by its path in the request
(``samples[2].old_logprobs``, ``loss.clip_eps_low``, ``optimizer.lr`` ...). proto3 cannot tell an
unset scalar from 0, so a few zeros mean "unset": a temperature of 0 means 1.0 (the rollout reports
greedy logprobs at temperature 1), ``epochs`` / ``minibatches`` of 0 mean 1, ``pack_tokens`` of 0
means the engine default, an empty ``kl_estimator`` means ``k3`` and empty ``extra_json`` means ``{}``.
Everything else must be given explicitly (an AdamW ``eps`` of 0 is refused, not defaulted).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from onpolicy.models.config import ModelConfig
from onpolicy.services.api import trainer_pb2
from onpolicy.services.common.errors import InvalidArgument
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainSample
from onpolicy.trainer.forward import ScoredSequence
from onpolicy.trainer.grpo import KL_ESTIMATORS, LOSS_AGGS


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


def _sequence(field: str, prompt: Sequence[int], tokens: Sequence[int], temperature: float,
              cfg: ModelConfig) -> ScoredSequence:
    seq = ScoredSequence(_ids(f"{field}.prompt_ids", prompt, cfg.vocab_size),
                         _ids(f"{field}.token_ids", tokens, cfg.vocab_size),
                         _temperature(f"{field}.temperature", temperature))
    if seq.input_len > cfg.max_position_embeddings:
        raise InvalidArgument(field, f"prompt + tokens need {seq.input_len} positions, the model has "
                                     f"{cfg.max_position_embeddings}")
    return seq


def scored_sequences(request: trainer_pb2.ComputeLogprobsRequest, cfg: ModelConfig) -> list[ScoredSequence]:
    if not request.sequences:
        raise InvalidArgument("sequences", "must not be empty")
    if request.pack_tokens < 0:
        raise InvalidArgument("pack_tokens", f"must be >= 0 (0 = default), got {request.pack_tokens}")
    return [_sequence(f"sequences[{i}]", s.prompt_ids, s.token_ids, s.temperature, cfg)
            for i, s in enumerate(request.sequences)]


def train_samples(samples: Sequence[trainer_pb2.TrainSample], cfg: ModelConfig) -> list[TrainSample]:
    if not samples:
        raise InvalidArgument("samples", "must not be empty")
    out = []
    for i, s in enumerate(samples):
        f = f"samples[{i}]"
        seq = _sequence(f, s.prompt_ids, s.token_ids, s.temperature, cfg)
        if len(s.old_logprobs) != len(s.token_ids):
            raise InvalidArgument(f"{f}.old_logprobs", f"has {len(s.old_logprobs)} values; token_ids has "
                                                       f"{len(s.token_ids)} (one logprob per token)")
        bad = [x for x in s.old_logprobs if not math.isfinite(x)]
        if bad:
            raise InvalidArgument(f"{f}.old_logprobs", f"must be finite, got {bad[0]}")
        out.append(TrainSample(prompt_ids=seq.prompt_ids, token_ids=seq.token_ids,
                               old_logprobs=tuple(s.old_logprobs), advantage=_finite(f"{f}.advantage", s.advantage),
                               temperature=seq.temperature))
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
                      loss_agg=msg.loss_agg, epochs=msg.epochs or 1, minibatches=minibatches)


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

