"""Accuracy against transformers' own implementation (the oracle), for every tiny family in fp32:
token logprobs of packed variable-length sequences on the training path, and the gradients of
their sum with respect to every parameter."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import Tensor

from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.tiny import tiny_checkpoint
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe")
LOGPROB_TOL = 1e-4
GRAD_RTOL = 1e-4
PAD_ID = 256  # pad_token_id of the tiny configs (also <|endoftext|>)

# prompt/continuation lengths: crossing the 16-position KV tile, a single-token prompt, a single
# scored token, sequences of very different lengths in one pack
SHAPES = [(1, 1), (5, 30), (17, 3), (3, 50), (40, 9), (2, 2)]
TEMPS = [1.0, 0.7, 1.0, 1.6, 1.0, 0.5]


def make_seqs(seed: int, vocab: int, avoid: frozenset[int] = frozenset()) -> list[ScoredSequence]:
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in avoid]
    return [ScoredSequence(tuple(rng.choice(ids) for _ in range(p)), tuple(rng.choice(ids) for _ in range(c)), t)
            for (p, c), t in zip(SHAPES, TEMPS, strict=True)]


def hf_model(name: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(name), dtype=torch.float32)
    return model.eval()


def hf_logprobs(model: transformers.PreTrainedModel, s: ScoredSequence) -> Tensor:
    """HF forward of one unpadded sequence; fp32 log-softmax at the sequence's temperature."""
    ids = torch.tensor([[*s.prompt_ids, *s.token_ids]])
    logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits / s.temperature, dim=-1)
    p = len(s.prompt_ids)
    return lp[p - 1:-1].gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]


def ours_in_hf_layout(ours: dict[str, Tensor], hf_names: list[str], num_experts: int) -> dict[str, Tensor]:
    """Our per-parameter tensors under HF's in-memory names. Names are identical except for
    transformers' fused MoE experts: ``experts.gate_up_proj [E, 2I, H]`` = cat(gate_proj, up_proj)
    per expert and ``experts.down_proj [E, H, I]``. Every one of our tensors must be used once."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for name in hf_names:
        if name in ours:
            out[name] = ours[name]
            used.add(name)
            continue
        m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        assert m, f"HF parameter {name} has no counterpart"
        prefix, kind = m.groups()
        parts = []
        for e in range(num_experts):
            names = ([f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"] if kind == "gate_up_proj"
                     else [f"{prefix}.{e}.down_proj.weight"])
            parts.append(torch.cat([ours[n] for n in names]))
            used.update(names)
        out[name] = torch.stack(parts)
    assert used == set(ours), f"unmapped parameters: {sorted(set(ours) - used)[:4]}"
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_match_transformers(load_tiny: Callable[..., object], name: str) -> None:
    model: CausalLM = load_tiny(name).model  # type: ignore[attr-defined]
    hf = hf_model(name)
    seqs = make_seqs(11, model.config.vocab_size)
    with torch.no_grad():
        ours = sequence_logprobs(model, seqs, pack_tokens=4096)  # all packed into one forward
        assert len({len(s.prompt_ids) + len(s.token_ids) for s in seqs}) > 1
        worst = 0.0
        for s, lp in zip(seqs, ours, strict=True):
            ref = hf_logprobs(hf, s)
            assert lp.shape == ref.shape
            worst = max(worst, (lp - ref).abs().max().item())
    assert worst <= LOGPROB_TOL, f"max |Δ logprob| = {worst:.3g}"


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_match_transformers(load_tiny: Callable[..., object], name: str) -> None:
    lm = load_tiny(name, fresh=True)
    model: CausalLM = lm.model  # type: ignore[attr-defined]
    assert not any(p.requires_grad for p in model.parameters()), "weights must load frozen"
    model.requires_grad_(True)
    hf = hf_model(name)
    # HF and we freeze the pad row of the embedding (nn.Embedding(padding_idx)); tested separately below
    seqs = make_seqs(12, model.config.vocab_size, avoid=frozenset({PAD_ID}))

    ours = sequence_logprobs(model, seqs, pack_tokens=4096)
    torch.stack([lp.sum() for lp in ours]).sum().backward()
    theirs = [hf_logprobs(hf, s) for s in seqs]
    torch.stack([lp.sum() for lp in theirs]).sum().backward()
    worst_lp = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert worst_lp <= LOGPROB_TOL

    hf_params = dict(hf.named_parameters())  # tied weights appear once, as in ours
    ours_p = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in ours_p and "lm_head.weight" not in hf_params
    # the mapping is right: it reproduces HF's weights exactly
    weights = ours_in_hf_layout({n: p.detach() for n, p in ours_p.items()}, list(hf_params), model.config.num_experts)
    for n, p in hf_params.items():
        assert torch.equal(weights[n], p.detach()), n
    missing = [n for n, p in ours_p.items() if p.grad is None]
    assert not missing, f"no gradient for {missing[:4]}"
    grads = ours_in_hf_layout({n: p.grad for n, p in ours_p.items()}, list(hf_params), model.config.num_experts)
    bad = []
    for n, p in hf_params.items():
        assert p.grad is not None, n
        err, scale = (grads[n] - p.grad).norm().item(), p.grad.norm().item()
        if not err <= GRAD_RTOL * scale + 1e-7:
            bad.append(f"{n}: |Δg| {err:.3g} vs |g| {scale:.3g}")
    assert not bad, bad[:5]


def test_pad_token_embedding_gradient_matches_transformers(load_tiny: Callable[..., object]) -> None:
    model: CausalLM = load_tiny("tiny-llama", fresh=True).model  # type: ignore[attr-defined]
    model.requires_grad_(True)
    hf = hf_model("tiny-llama")
    s = ScoredSequence((5, PAD_ID, 7), (8, 9))
    sequence_logprobs(model, [s])[0].sum().backward()
    hf_logprobs(hf, s).sum().backward()
    g_ours = model.model.embed_tokens.weight.grad
    g_hf = hf.model.embed_tokens.weight.grad
    assert g_ours is not None and g_hf is not None
    torch.testing.assert_close(g_ours[PAD_ID], g_hf[PAD_ID], atol=1e-6, rtol=1e-4)
