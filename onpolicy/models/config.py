"""``ModelConfig``: the architecture of one model, read from an HF ``config.json`` dict.

``ModelConfig.from_hf`` reads what transformers' Llama, Qwen2, Qwen3 and Qwen3-MoE configs carry, and
reads it as transformers does: a field a ``config.json`` leaves out takes the default of that
family's transformers config class (Qwen3's ``head_dim`` 128, Qwen3-MoE's ``norm_topk_prob`` false,
…), ``rope_scaling`` replaces ``rope_parameters``, and a ``rope_theta`` inside the RoPE parameters
wins over a top-level one. A field whose value the model code does not reproduce is refused with a
one-line ``ValueError`` naming it: sliding-window attention that would take effect, a RoPE type
other than default/linear/llama3, a partial rotary dimension, an activation other than SiLU, MLP
biases, RoPE parameters per layer type, quantized weights. ``read_config_json`` reads a
``config.json`` with a size bound. Dropout rates are accepted and never
applied: every forward, the trainer's included, is the eval-mode one the rollout computes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from onpolicy.kernels.selftest import ProbeShapes

#: The largest ``config.json`` read (real ones are a few KiB): a larger file is refused unread.
MAX_CONFIG_BYTES = 1 << 20


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the ``config.json`` at ``path``, read at most ``MAX_CONFIG_BYTES``;
    ``ValueError`` (one line naming the file) when it is larger, not UTF-8 JSON or not an object."""
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a model config")
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a JSON model config ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
_FAMILIES: dict[str, Family] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
RopeType = Literal["default", "linear", "llama3"]
ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are SiLU
_LAYER_TYPES = ("full_attention", "sliding_attention")

#: transformers' config-class defaults (5.x) of the fields a ``config.json`` may leave out, where
#: they differ between the families or from the defaults below.
_DEFAULTS: dict[Family, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": None,
                  "norm_topk_prob": False},
}


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """The RoPE frequency rule: ``default`` (HF's plain RoPE), ``linear`` (every inverse frequency
    divided by ``factor``) or ``llama3`` (Llama 3.1's band-wise rule: long wavelengths divided by
    ``factor``, short ones kept, the band between interpolated)."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model config: rope_type {self.rope_type!r} is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"model config: rope factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not (self.high_freq_factor > self.low_freq_factor > 0
                                               and self.original_max_position_embeddings > 0):
            raise ValueError("model config: llama3 RoPE needs high_freq_factor > low_freq_factor > 0 and "
                             "original_max_position_embeddings > 0")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """Llama's (and Qwen3's) ``attention_bias``: a bias on q, k, v and o_proj. Qwen2 has its own fixed
    rule instead (see ``qkv_bias`` / ``o_bias``)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # MoE (qwen3_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    """As in HF: the embedding row of this id gets no gradient (``nn.Embedding(padding_idx=...)``)."""
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("model config: head_dim must be even for rotary embeddings")
        moe_ok = 1 <= self.num_experts_per_tok <= self.num_experts
        if self.family == "qwen3_moe" and not moe_ok:
            raise ValueError("model config: qwen3_moe needs num_experts >= num_experts_per_tok >= 1")

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        """A bias on q/k/v_proj: always for Qwen2, else ``attention_bias``."""
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        """A bias on o_proj: never for Qwen2, else ``attention_bias``."""
        return self.family != "qwen2" and self.attention_bias

    def probe_shapes(self) -> ProbeShapes:
        """The shapes the selftest certifies a backend on for this model."""
        from onpolicy.kernels.selftest import ProbeShapes

        return ProbeShapes(hidden=self.hidden_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, intermediate=self.intermediate_size or self.moe_intermediate_size,
                           vocab=self.vocab_size, num_experts=max(self.num_experts, 8),
                           top_k=max(self.num_experts_per_tok, 2))

    def is_moe_layer(self, layer: int) -> bool:
        return (self.family == "qwen3_moe" and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        try:
            return cls._from_hf(cfg)
        except KeyError as e:
            raise ValueError(f"model config: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"model config: bad value ({e})") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
        family = _FAMILIES[model_type]
        defaults = _DEFAULTS[family]
        _check_refused(cfg, family)
        theta, scaling = _rope(cfg, family)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", defaults["num_key_value_heads"])
        head_dim = cfg.get("head_dim", defaults["head_dim"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads or heads,
            head_dim=head_dim or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", defaults["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", defaults.get("norm_topk_prob", True))),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id") if isinstance(cfg.get("pad_token_id"), int) else None,
            eos_token_ids=eos_ids,
        )


def _check_refused(cfg: dict[str, Any], family: Family) -> None:
    """A ``ValueError`` naming the first field whose value this model code does not reproduce."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(f"model config: quantization_config ({method}) is not supported; give unquantized weights")
    act = cfg.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"model config: hidden_act {act!r} is not supported (the MLP is SwiGLU: silu only)")
    if family == "llama" and cfg.get("mlp_bias"):
        raise ValueError("model config: mlp_bias: true is not supported (the MLP projections have no bias)")
    sliding = _sliding_layers(cfg, family)
    if sliding:
        raise ValueError(f"model config: use_sliding_window: true (a {cfg.get('sliding_window', 4096)}-token window on "
                         f"{len(sliding)} layers from layer {sliding[0]}) is not supported; only full attention is "
                         "implemented")


def _sliding_layers(cfg: dict[str, Any], family: Family) -> list[int]:
    """The layers transformers would run with sliding-window attention that changes anything (a
    window at least ``max_position_embeddings`` long masks nothing)."""
    if family == "llama":
        return []  # LlamaConfig has no sliding window
    types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if types is not None:
        bad = sorted({t for t in types if t not in _LAYER_TYPES})
        if bad or len(types) != n:
            raise ValueError(f"model config: layer_types must be {n} of {', '.join(_LAYER_TYPES)}; got {bad or types}")
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    max_pos = cfg.get("max_position_embeddings", _DEFAULTS[family]["max_position_embeddings"])
    if window is None or window >= max_pos:
        return []
    if family == "qwen3_moe":  # every layer takes config.sliding_window
        return list(range(n))
    if types is None:
        start = cfg.get("max_window_layers", 28)
        return [i for i in range(n) if i >= start]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _rope(cfg: dict[str, Any], family: Family) -> tuple[float, RopeScaling]:
    """``(rope_theta, RopeScaling)`` as transformers 5 resolves them (``RotaryEmbeddingConfigMixin``)."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"model config: {name} must be an object or null, got {type(rope).__name__}")
    if "rope_type" not in rope and "type" not in rope and any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"model config: {name} per layer type ({', '.join(rope)}) is not supported")
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"model config: partial_rotary_factor {factor} is not supported (rotary over the whole "
                         "head_dim only)")
    theta = rope.get("rope_theta")
    theta = cfg.get("rope_theta") if theta is None else theta
    theta = 10000.0 if theta is None else theta
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"model config: {name}.rope_type {kind!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return float(theta), RopeScaling()
    try:
        if kind == "linear":
            return float(theta), RopeScaling(rope_type="linear", factor=float(rope["factor"]))
        original = (cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings", _DEFAULTS[family]["max_position_embeddings"]))
        return float(theta), RopeScaling(rope_type="llama3", factor=float(rope["factor"]),
                                         low_freq_factor=float(rope["low_freq_factor"]),
                                         high_freq_factor=float(rope["high_freq_factor"]),
                                         original_max_position_embeddings=int(original or 0))
    except KeyError as e:
        raise ValueError(f"model config: {name} of rope_type {kind!r} is missing {e.args[0]!r}") from None
