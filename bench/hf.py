"""The transformers baseline: the same weights in transformers' own model classes."""

from __future__ import annotations

import torch

from onpolicy.models.checkpoint import LoadedModel


def hf_model(lm: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers ``*ForCausalLM`` holding exactly ``lm``'s weights."""
    import transformers

    fam = lm.config.family
    cls = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[fam]
    c = lm.config
    kwargs = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                  max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    if fam == "qwen3_moe":
        kwargs.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                      moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                      decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))
    config = getattr(transformers, f"{cls}Config")(**kwargs)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    state = {k: v.detach().to(torch.float32) for k, v in lm.model.state_dict().items()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()
