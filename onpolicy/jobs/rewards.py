"""Rule-based rewards, chosen by registered name (never code sent over the wire)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardInput:
    prompt: str
    completion: str
    answer: str
    num_tokens: int
    max_new_tokens: int


RewardFn = Callable[[RewardInput], float]
REWARDS: dict[str, RewardFn] = {}


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return register


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    nums = _NUMBER.findall(text.replace(",", ""))
    return float(nums[-1]) if nums else None


@reward("exact_answer")
def exact_answer(x: RewardInput) -> float:
    """1 if the last number in the completion equals the numeric answer, else 0."""
    got, want = last_number(x.completion), last_number(x.answer)
    return 1.0 if got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9) else 0.0


@reward("format")
def answer_format(x: RewardInput) -> float:
    """1 if the completion states its answer as ``answer: N`` (or ``= N``), else 0."""
    return 1.0 if re.search(r"(answer\s*(is|:)|=)\s*-?\d", x.completion, re.IGNORECASE) else 0.0


@reward("length_penalty")
def length_penalty(x: RewardInput) -> float:
    """-(fraction of the token budget used): shorter completions score higher."""
    return -x.num_tokens / max(1, x.max_new_tokens)


def total_reward(names_weights: list[tuple[str, float]], x: RewardInput) -> float:
    return sum(w * REWARDS[n](x) for n, w in names_weights)
