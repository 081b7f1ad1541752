"""Our chat-template rendering equals transformers' ``apply_chat_template(..., add_generation_prompt=
True)`` token for token, wherever the checkpoint keeps its template (``chat_template.jinja`` as
transformers 5 writes it, or ``tokenizer_config.json``), with the special tokens the template uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onpolicy.models.registry import load_tokenizer
from onpolicy.models.tiny import byte_tokenizer, tiny_checkpoint

transformers = pytest.importorskip("transformers")

MESSAGES = ["What is 2 + 3?", "Résumé: naïve café ☕ — done?", "", "line one\nline two\n\n  indented"]
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def theirs(path: Path, message: str) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    out = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def ours(path: Path, message: str) -> list[int]:
    tok = load_tokenizer(str(path))
    assert tok is not None and tok.chat_template
    return tok.encode(tok.chat_prompt(message))


def copy_checkpoint(tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("tiny-qwen3"), dest)
    return dest


def move_template_to_jinja(path: Path) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "chat_template.jinja").write_text(config.pop("chat_template"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("location", ["tokenizer_config.json", "chat_template.jinja"])
def test_rendering_equals_transformers_in_both_locations(tmp_path: Path, location: str) -> None:
    path = copy_checkpoint(tmp_path)
    if location == "chat_template.jinja":
        move_template_to_jinja(path)
        assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    for message in MESSAGES:
        got = ours(path, message)
        assert got == theirs(path, message)
        assert got != load_tokenizer(str(path)).encode(message)  # the template was applied, not raw text


def test_the_jinja_file_wins_over_tokenizer_config_like_transformers(tmp_path: Path) -> None:
    path = copy_checkpoint(tmp_path)
    (path / "chat_template.jinja").write_text("JINJA:{{ messages[0]['content'] }}")
    assert ours(path, "x") == theirs(path, "x") == load_tokenizer(str(path)).encode("JINJA:x")


def test_a_llama3_template_keeps_its_bos_token(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    path = copy_checkpoint(tmp_path)
    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True) for s in LLAMA3_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "chat_template.jinja").write_text(LLAMA3)
    begin = tok.token_to_id("<|begin_of_text|>")
    for message in MESSAGES:
        got = ours(path, message)
        assert got == theirs(path, message)
        assert got[0] == begin
    loaded = load_tokenizer(str(path))
    assert loaded.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert loaded.eos_token_ids == (tok.token_to_id("<|eot_id|>"),)


@pytest.mark.smollm2
def test_smollm2_rendering_equals_transformers_on_its_export(tmp_path: Path) -> None:
    from onpolicy.models.hf_export import hf_directory

    export = hf_directory("smollm2")
    tok = load_tokenizer("smollm2")
    for message in MESSAGES:
        assert tok.encode(tok.chat_prompt(message)) == theirs(export, message)
