"""A job's problems made into the token ids the rollout is sent: the prompt rendered with the model's
chat template (``dataset.chat_template``, when the model has one), tokenized like transformers'
``apply_chat_template``, and dropped when longer than ``rollout.max_prompt_tokens``."""

from __future__ import annotations

from dataclasses import dataclass

from onpolicy.models.tokenizer import Tokenizer

from .dataset import DatasetError, Problem


@dataclass(frozen=True)
class Prompt:
    problem: Problem
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    prompts: list[Prompt]
    dropped: int
    """Problems dropped for a prompt longer than the limit."""

    def summary(self, what: str, limit: int) -> str:
        total = len(self.prompts) + self.dropped
        return (f"{what}: {len(self.prompts)} of {total} prompts kept, {self.dropped} longer than "
                f"rollout.max_prompt_tokens={limit} dropped")


def prepare(problems: list[Problem], tokenizer: Tokenizer | None, chat_template: bool, max_tokens: int,
            what: str = "dataset") -> Prepared:
    """``problems`` as prompts of at most ``max_tokens`` tokens (``DatasetError`` when none is left)."""
    if tokenizer is None:
        raise DatasetError(f"{what}: the model has no tokenizer to encode the prompts with")
    kept, dropped = [], 0
    for p in problems:
        text = tokenizer.chat_prompt(p.prompt) if chat_template else p.prompt
        ids = tuple(tokenizer.encode(text))
        if not ids or len(ids) > max_tokens:
            dropped += 1
            continue
        kept.append(Prompt(p, ids))
    if problems and not kept:
        raise DatasetError(f"{what}: every one of its {len(problems)} prompts is longer than "
                           f"rollout.max_prompt_tokens={max_tokens} tokens (or empty)")
    return Prepared(kept, dropped)
