"""``ModelConfig``: the architecture of one model, read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from onpolicy.kernels.selftest import ProbeShapes

Family = Literal["llama", "qwen3", "qwen3_moe"]
_FAMILIES: dict[str, Family] = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


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
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope type {rope_type!r} (only default RoPE is implemented)")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=_FAMILIES[model_type],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id") if isinstance(cfg.get("pad_token_id"), int) else None,
            eos_token_ids=eos_ids,
        )
