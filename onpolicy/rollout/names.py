"""Rollout engine names (the job spec's ``rollout.engine``, the CLI's ``--engine``), importable
without torch or vLLM: ``onpolicy`` (our ``RolloutEngine``), ``vllm``, and ``vllm-ascend``, an alias of
``vllm`` that selects the Ascend operators."""

from __future__ import annotations

OWN_ENGINE = "onpolicy"
VLLM = "vllm"
ALIASES = {"vllm-ascend": VLLM}
ENGINES = (OWN_ENGINE, VLLM, *ALIASES)


def canonical(name: str) -> str:
    """The engine an accepted name stands for (``ValueError`` for an unknown one)."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; engines are {list(ENGINES)}")
    return ALIASES.get(name, name)
