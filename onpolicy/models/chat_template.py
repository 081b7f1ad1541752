"""Chat templates: where a checkpoint keeps one, and rendering it the way ``transformers``'
``apply_chat_template(..., add_generation_prompt=True)`` does.

A template is found, in this order, in ``chat_template.jinja`` (what transformers 5 writes), then in
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of which
``default`` is taken), and in a GGUF file's ``tokenizer.chat_template``. The renderer passes the
tokenizer's special tokens (``bos_token``, ``eos_token``, …) to the template as transformers does, so a
Llama-3-style template keeps its ``<|begin_of_text|>``; the rendered text is then encoded without
adding special tokens (again as transformers does).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: The special-token entries of ``tokenizer_config.json`` that transformers passes to a template.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or rendered."""


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it: a string, or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template a checkpoint directory carries, or None."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{model_dir}/tokenizer_config.json: chat_template is not a string")
    return template


def special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, … of a ``tokenizer_config.json``, where it names them."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(tokenizer_config.get(key))
        if text is not None:
            out[key] = text
    return out


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: not a JSON object")
    return data


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: plain json.dumps instead of Jinja's HTML-escaping tojson.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(chat_template)


def render_chat(chat_template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                **extra: Any) -> str:
    """Render a HF-style Jinja chat template the way ``tokenizer.apply_chat_template(tokenize=False)`` does.

    ``extra`` is passed to the template as further variables (``bos_token``, ``eos_token``, ``tools``…).
    """
    return _compile(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
