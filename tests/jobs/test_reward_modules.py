"""Rewards by import path: a ``module:function`` the operator installed, loaded only from a package the
controller allows, never sent as code; and the ``math_verify`` reward with ``\\boxed{}`` extraction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from onpolicy.jobs.rewards import RewardError, RewardInput, RewardSet, last_boxed, load_reward


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "userrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "def contains_answer(x):\n    return float(x.answer in x.completion)\n\n"
        "def not_a_number(x):\n    return 'yes'\n\nNOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userrewards"
    sys.modules.pop("userrewards", None)


X = RewardInput("q", "the answer is 42", "42", 5, 16)


def test_an_allowed_module_reward_loads_and_scores(package: str) -> None:
    fn = load_reward(f"{package}:contains_answer", [package])
    assert fn(X) == 1.0
    rewards = RewardSet.load([(f"{package}:contains_answer", 2.0), ("length_penalty", 1.0)], [package])
    assert rewards.total(X) == 2.0 - 5 / 16


def test_a_module_reward_outside_the_allowed_packages_is_refused(package: str) -> None:
    with pytest.raises(RewardError, match="package 'userrewards' is not allowed on this controller"):
        load_reward(f"{package}:contains_answer")
    assert package not in sys.modules  # refused before anything was imported
    with pytest.raises(RewardError, match="no callable 'NOT_CALLABLE'"):
        load_reward(f"{package}:NOT_CALLABLE", [package])
    with pytest.raises(RewardError, match=r"cannot import userrewards\.missing"):
        load_reward(f"{package}.missing:f", [package])


def test_a_reward_that_returns_a_non_number_fails_naming_it(package: str) -> None:
    rewards = RewardSet.load([(f"{package}:not_a_number", 1.0)], [package])
    with pytest.raises(RewardError, match="userrewards:not_a_number' returned 'yes'"):
        rewards.total(X)


def test_boxed_extraction_balances_braces() -> None:
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None


@pytest.mark.parametrize(("completion", "answer", "want"), [
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{2/4}", r"\frac{1}{2}", 1.0),
    (r"\boxed{3}", "4", 0.0),
    ("no box, but the answer is 7", "7", 1.0),
    ("nothing here", "7", 0.0),
])
def test_math_verify_reward(completion: str, answer: str, want: float) -> None:
    pytest.importorskip("math_verify")
    fn = load_reward("math_verify")
    assert fn(RewardInput("q", completion, answer, 1, 8)) == want
