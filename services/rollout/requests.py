"""Validation of rollout requests: proto messages -> domain types, or ``InvalidArgument`` naming the
field (``params.temperature``, ``prompts[3].prompt_ids``, ...)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import RolloutEngine, SamplingParams
from onpolicy.services.api import rollout_pb2
from onpolicy.services.common.errors import InvalidArgument, ResourceExhausted


def sampling_params(msg: rollout_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidArgument("params.temperature", f"must be a finite number >= 0 (0 = greedy), got {msg.temperature}")
    if msg.max_new_tokens < 1:
        raise InvalidArgument("params.max_new_tokens", f"must be >= 1, got {msg.max_new_tokens}")
    if msg.n < 0:
        raise InvalidArgument("params.n", f"must be >= 1 (0 means 1), got {msg.n}")
    for j, t in enumerate(msg.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"params.stop_token_ids[{j}]", f"{t} is outside the vocabulary [0, {vocab_size})")
    try:
        return SamplingParams(temperature=msg.temperature, max_new_tokens=msg.max_new_tokens,
                              stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, n=msg.n or 1,
                              seed=msg.seed, top_p=msg.top_p or 1.0, top_k=msg.top_k, min_p=msg.min_p)
    except ValueError as e:  # anything SamplingParams checks beyond the above
        raise InvalidArgument("params", str(e)) from None


def prompt_ids(prompts: Sequence[rollout_pb2.Prompt], lm: LoadedModel, engine: RolloutEngine,
               params: SamplingParams) -> list[list[int]]:
    """Token ids of every prompt; text prompts are rendered with the chat template and tokenized."""
    if not prompts:
        raise InvalidArgument("prompts", "must contain at least one prompt")
    vocab = lm.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if p.prompt_ids and p.text:
            raise InvalidArgument(f"prompts[{i}]", "give prompt_ids or text, not both")
        if p.text:
            if lm.tokenizer is None:
                raise InvalidArgument(f"prompts[{i}].text", f"model {lm.name} has no tokenizer: send prompt_ids")
            ids = lm.tokenizer.encode(lm.tokenizer.chat_prompt(p.text))
            field = f"prompts[{i}].text"
        else:
            ids = list(p.prompt_ids)
            field = f"prompts[{i}].prompt_ids"
            if not ids:
                raise InvalidArgument(field, "the prompt is empty (give prompt_ids or text)")
            bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument(field, f"token {bad} = {ids[bad]} is outside the vocabulary [0, {vocab})")
        try:
            engine.validate(ids, params)
        except ValueError as e:
            raise InvalidArgument(field, str(e)) from None
        out.append(ids)
    return out


def check_size(num_prompts: int, params: SamplingParams, max_sequences: int) -> None:
    if num_prompts * params.n > max_sequences:
        raise ResourceExhausted(f"request asks for {num_prompts} prompts x {params.n} samples; this service "
                                f"takes at most {max_sequences} sequences per request")
