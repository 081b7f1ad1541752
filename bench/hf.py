"""The transformers baseline: the same weights in transformers' own model classes, its cached
``generate`` and its forward+backward."""

from __future__ import annotations

import torch

from onpolicy.models.loading import LoadedModel

from .common import median_time


def hf_model(lm: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers ``*ForCausalLM`` holding exactly ``lm``'s weights."""
    import transformers

    fam = lm.config.family
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[fam]
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


def hf_generate_seconds(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Median wall time of greedy cached ``generate`` of exactly ``new_tokens`` per prompt."""
    ids = torch.tensor(prompts)

    def run(n: int = new_tokens) -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, use_cache=True, pad_token_id=0)

    return median_time(run, repeats, warm=lambda: run(2))


def hf_cached_logdiff(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    """max |logp(cached generate) - logp(full forward)| of transformers on its own greedy tokens."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        gen = out.sequences[:, ids.shape[1]:]
        cached = torch.stack([torch.log_softmax(lg.float(), -1) for lg in out.logits], 1)
        cached = cached.gather(2, gen[..., None])[..., 0]
        full = torch.log_softmax(hf(out.sequences).logits.float(), -1)[:, ids.shape[1] - 1:-1]
        full = full.gather(2, gen[..., None])[..., 0]
    return float((cached - full).abs().max())


def hf_train_seconds(hf: torch.nn.Module, seqs: list[list[int]], repeats: int) -> float:
    """Median wall time of one forward+backward of transformers over equally long ``seqs``: fp32
    log-softmax of the logits, the sum of every next-token logprob as the loss."""
    ids = torch.tensor(seqs)
    hf.requires_grad_(True)

    def run() -> None:
        logits = hf(ids[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])
        (-lp.sum()).backward()
        hf.zero_grad(set_to_none=True)

    try:
        return median_time(run, repeats)
    finally:
        hf.requires_grad_(False)
