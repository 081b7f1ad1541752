"""Rewards: the registered rule-based ones, chosen by name, and ``module:function`` callables the
operator installed on the cluster, loaded by the services when the controller allows their package
(never code sent over the wire).

A reward is ``fn(x: RewardInput) -> float``.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Collection
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


_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


@reward("math_verify")
def math_verify(x: RewardInput) -> float:
    """1 if the completion's final answer (its last ``\\boxed{}``, else the whole completion) is
    mathematically equal to the reference answer, as decided by the ``math-verify`` library
    (LaTeX and plain expressions, fractions, sets, …); else 0."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RewardError("reward math_verify needs the math-verify package (pip install 'onpolicy[data]')") from e
    boxed = last_boxed(x.completion)
    got = parse(f"${boxed}$" if boxed is not None else x.completion, parsing_timeout=None)
    want = parse(x.answer if "$" in x.answer or _BOXED in x.answer else f"${x.answer}$", parsing_timeout=None)
    return 1.0 if got and want and verify(want, got, timeout_seconds=None) else 0.0


class RewardError(ValueError):
    """A reward that cannot be loaded or that returned something other than a finite number."""


_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def is_reward_path(name: str) -> bool:
    """Whether ``name`` has the ``module:function`` form of an installed reward."""
    return bool(_PATH.match(name))


def load_reward(name: str, allowed_modules: Collection[str] = ()) -> RewardFn:
    """The reward called ``name``: registered, or ``module:function`` whose top-level package is in
    ``allowed_modules`` (``RewardError`` otherwise, naming what is missing)."""
    if name in REWARDS:
        return REWARDS[name]
    if not is_reward_path(name):
        raise RewardError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}")
    module_name, _, attr = name.partition(":")
    if module_name.split(".")[0] not in allowed_modules:
        allowed = ", ".join(sorted(allowed_modules)) or "none"
        raise RewardError(f"reward {name!r}: package {module_name.split('.')[0]!r} is not allowed on this "
                          f"controller (allowed: {allowed}; start it with --allow-reward-modules)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an operator's module may raise anything on import
        raise RewardError(f"reward {name!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: {module_name} has no callable {attr!r}")
    return fn


def score(fn: RewardFn, name: str, x: RewardInput) -> float:
    """``fn(x)`` as a float, or ``RewardError`` naming the reward when it is not a finite number."""
    value = fn(x)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r}, not a finite number")
    return float(value)


@dataclass(frozen=True)
class RewardSet:
    """A job's weighted rewards, loaded once."""

    terms: tuple[tuple[str, float, RewardFn], ...]

    @classmethod
    def load(cls, names_weights: list[tuple[str, float]], allowed_modules: Collection[str] = ()) -> RewardSet:
        return cls(tuple((n, w, load_reward(n, allowed_modules)) for n, w in names_weights))

    def total(self, x: RewardInput) -> float:
        return sum(w * score(fn, n, x) for n, w, fn in self.terms)

    def one(self, name: str, x: RewardInput) -> float:
        return next(score(fn, n, x) for n, _, fn in self.terms if n == name)


def total_reward(names_weights: list[tuple[str, float]], x: RewardInput) -> float:
    """The weighted sum of registered rewards (``RewardSet`` for installed ones)."""
    return RewardSet.load(names_weights).total(x)
