"""``Tokenizer``: a thin wrapper over a ``tokenizers.Tokenizer`` plus the chat template and the special
tokens the template is rendered with."""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers

from .chat_template import render_chat


@dataclass(frozen=True)
class Tokenizer:
    inner: tokenizers.Tokenizer
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, str] = field(default_factory=dict)
    """``bos_token``, ``eos_token``, … by name (passed to the chat template, as transformers does)."""

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user_message: str) -> str:
        """The user message rendered with the model's chat template and a generation prompt (plain text
        if it has none): the text ``apply_chat_template(..., add_generation_prompt=True)`` gives."""
        if not self.chat_template:
            return user_message
        return render_chat(self.chat_template, [{"role": "user", "content": user_message}], **self.special_tokens)
