"""Invariant speculative decoding: the n-gram (prompt-lookup) proposer and the acceptance rule.

A decoding request's draft is the ``k`` tokens that followed the most recent earlier occurrence of
its last n-gram (longest ``n`` in ``[ngram_min, ngram_max]`` first) in its prompt + output. The model
runner computes the request's last token and its draft in one forward; the kernels are row-invariant,
so the logits at each of those ``k + 1`` positions are bitwise those of plain decoding, and the keyed
sampler (key = request, step = token index) picks at each position the token plain decoding would.
:func:`accept` keeps drafted tokens while they equal those picks and ends with the sampler's token at
the first mismatch (or after the last draft): the same tokens and logprob bits as without drafts, at
any temperature and truncation. Plain Python; never touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NONE = "none"
NGRAM = "ngram"
METHODS = (NONE, NGRAM)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str = NONE
    """``none`` (plain decoding) or ``ngram`` (prompt-lookup drafts)."""
    num_tokens: int = 4
    """Most drafted tokens per request and step (``k``)."""
    ngram_min: int = 2
    """Shortest suffix n-gram looked up (as vLLM's ``prompt_lookup_min``)."""
    ngram_max: int = 4
    """Longest suffix n-gram looked up (as vLLM's ``prompt_lookup_max``)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 64], got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be >= 1 and <= ngram_max ({self.ngram_max})")

    @property
    def enabled(self) -> bool:
        return self.method != NONE


def propose_ngram(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """``k`` tokens continuing the copy that the most recent earlier occurrence of the longest suffix
    n-gram of ``tokens`` (``ngram_max`` down to ``ngram_min``) starts: the tokens that followed it,
    read on into the draft itself where they run out (a repeating pattern is drafted in full);
    empty when no n-gram occurs earlier or ``k < 1``."""
    size = len(tokens)
    if k < 1:
        return []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = list(tokens[size - n:])
        last = suffix[-1]
        # the occurrence must end before the suffix itself, so it has at least one follower
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and list(tokens[end - n + 1:end + 1]) == suffix:
                draft = list(tokens[end + 1:end + 1 + k])
                while len(draft) < k:  # the source runs into the suffix: continue from the draft
                    draft.append(draft[end + 1 + len(draft) - size])
                return draft
    return []


def accept(draft: Sequence[int], picks: Sequence[int]) -> int:
    """How many leading drafted tokens equal the sampler's picks at their positions
    (``picks[j]`` is the token sampled after the request's last token and ``draft[:j]``)."""
    n = 0
    while n < len(draft) and draft[n] == picks[n]:
        n += 1
    return n
