"""Tiny random checkpoints of every family (``tiny-llama``, ``tiny-qwen2``, ``tiny-qwen3``,
``tiny-qwen3-moe``, head_dim 16; the same with ``-hd32``: head_dim 32, the smallest vLLM's CPU
attention runs).

Built offline with transformers' own config and model classes from a fixed seed (biases, which
transformers initialises to zero, drawn at random too, so that they matter), saved as HF
directories (config.json + safetensors + a byte-level tokenizer) and cached under
``$ONPOLICY_HOME/models`` (default ``~/.cache/onpolicy/models``). The write is atomic: a build goes
to a temporary directory that is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onpolicy.home import onpolicy_home

SEED = 1234
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # 256 bytes + specials, rounded up

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
    bos_token_id=None, eos_token_id=[256, 258], pad_token_id=256,
)
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(_COMMON, tie_word_embeddings=False, rope_theta=10000.0)),
    # Qwen2.5's shape of config: q/k/v bias, tied embeddings, a sliding window that is switched off
    "tiny-qwen2": ("qwen2", dict(_COMMON, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False,
                                 sliding_window=32, max_window_layers=1)),
    "tiny-qwen3": ("qwen3", dict(_COMMON, tie_word_embeddings=True, rope_theta=1000000.0)),
    "tiny-qwen3-moe": ("qwen3_moe", dict(_COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                                         rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
                                         decoder_sparse_step=1)),
}
# head_dim 32: the smallest vLLM's CPU attention accepts (its tests use these)
_HD32: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, head_dim=32)
SPECS.update({
    "tiny-llama-hd32": ("llama", dict(SPECS["tiny-llama"][1], **_HD32)),
    "tiny-qwen2-hd32": ("qwen2", dict(SPECS["tiny-qwen2"][1], **_HD32)),
    "tiny-qwen3-hd32": ("qwen3", dict(SPECS["tiny-qwen3"][1], **_HD32)),
    "tiny-qwen3-moe-hd32": ("qwen3_moe", dict(SPECS["tiny-qwen3-moe"][1], **_HD32, moe_intermediate_size=64)),
})
#: transformers' class-name prefix of each family (``{prefix}Config``, ``{prefix}ForCausalLM``)
HF_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def home() -> Path:
    return onpolicy_home()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer() -> Any:
    """A byte-level tokenizer: one token per byte (ids 0..255) plus the chat specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def random_hf_model(family: str, kwargs: dict[str, Any], seed: int) -> Any:
    """A transformers ``*ForCausalLM`` of ``family`` with random fp32 weights (biases random too:
    transformers starts them at zero, which would hide a bias that is not applied)."""
    try:
        import torch
        import transformers
    except ImportError as e:  # pragma: no cover - the hf extra is part of every documented install
        raise RuntimeError(f"building a {family} checkpoint needs transformers (pip install 'onpolicy[hf]')") from e
    cls_name = HF_CLASSES[family]
    config = getattr(transformers, f"{cls_name}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls_name}ForCausalLM")(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def _build(name: str, dest: Path) -> None:
    family, kwargs = SPECS[name]
    model = random_hf_model(family, kwargs, SEED)
    # transformers writes nothing from a torch.distributed rank other than 0, and a parallel engine's
    # peer rank may be the first process to build a tiny model: this build always writes.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(dest)
    missing = [f for f in ("config.json", "model.safetensors") if not (dest / f).is_file()]
    if missing:
        raise RuntimeError(f"building {name}: transformers did not write {', '.join(missing)}")
    byte_tokenizer().save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))


def tiny_checkpoint(name: str) -> Path:
    """Path of the cached tiny checkpoint ``name``, building it on first use."""
    if name not in SPECS:
        raise KeyError(name)
    key = hashlib.sha256(json.dumps([SPECS[name], SEED], sort_keys=True).encode()).hexdigest()[:10]
    path = home() / "models" / f"{name}-{key}"
    if (path / "config.json").is_file():
        return path
    return build_model_dir(path, lambda tmp: _build(name, tmp))


def build_model_dir(path: Path, build: Callable[[Path], None]) -> Path:
    """``build(tmp)`` into a temporary directory beside ``path``, renamed into place: a crash leaves
    no half-written model, and of two racing builds the first to finish wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(tmp)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
