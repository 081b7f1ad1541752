"""``Tokenizer``: a thin wrapper over a ``tokenizers.Tokenizer`` plus the chat template."""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers


@dataclass(frozen=True)
class Tokenizer:
    inner: tokenizers.Tokenizer
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user_message: str) -> str:
        """The user message rendered with the model's chat template (plain text if it has none)."""
        if not self.chat_template:
            return user_message
        from .gguf import render_chat

        return render_chat(self.chat_template, [{"role": "user", "content": user_message}])
