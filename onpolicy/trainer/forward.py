"""The training-path forward: teacher-forced token logprobs of packed variable-length sequences.

Sequences (``prompt_ids`` + ``token_ids``) are packed back to back into batches of at most
``pack_tokens`` rows (a sequence is never split; one longer than the budget gets a batch of its own),
run through the model under a ``PackedContext``, and the logprob of every continuation token is read
at its sampling temperature and truncation (top-k / top-p / min-p: the renormalised distribution the
rollout sampled from, ``onpolicy.kernels.truncation``). It runs with or without autograd and gives
the same bits either way; by the invariance rule it gives the same bits for any packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from onpolicy.kernels import Backend
from onpolicy.kernels.truncation import RowTruncation, Truncation
from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.context import PackedContext


@dataclass(frozen=True)
class ScoredSequence:
    """A prompt and a continuation whose tokens are scored (teacher forcing)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    """The truncation the tokens were sampled with (off: 0, 1, 0); see ``onpolicy.kernels.truncation``."""

    def __post_init__(self) -> None:
        self.truncation  # noqa: B018 - validates
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not self.token_ids:
            raise ValueError("token_ids must not be empty")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def truncation(self) -> Truncation:
        return Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    @property
    def untruncated(self) -> ScoredSequence:
        """The same tokens scored on the full distribution at the temperature (the KL reference's
        logprobs: a token outside the reference's own truncation would score -inf)."""
        return replace(self, top_k=0, top_p=1.0, min_p=0.0)

    @property
    def input_len(self) -> int:
        """Rows fed to the model: the last continuation token is only a target."""
        return len(self.prompt_ids) + len(self.token_ids) - 1


def pack(seqs: Sequence[ScoredSequence], pack_tokens: int) -> list[list[int]]:
    """Greedy in-order packing of sequence indices into batches of at most ``pack_tokens`` rows."""
    if pack_tokens < 1:
        raise ValueError(f"pack_tokens must be >= 1, got {pack_tokens}")
    packs: list[list[int]] = []
    rows = 0
    for i, s in enumerate(seqs):
        if packs and rows + s.input_len <= pack_tokens:
            packs[-1].append(i)
            rows += s.input_len
        else:
            packs.append([i])
            rows = s.input_len
    return packs


def pack_logprobs(model: CausalLM, seqs: Sequence[ScoredSequence], ops: Backend | None = None, *,
                  entropy: list[Tensor] | None = None) -> list[Tensor]:
    """Logprobs (fp32 ``[len(token_ids)]`` each) of one pack of sequences in one forward pass. With an
    ``entropy`` list, the entropy of the distribution at every continuation position (fp32, same
    shapes, differentiable under autograd) is appended to it per sequence; the logprobs keep their bits."""
    device = model.device
    ids = torch.tensor([t for s in seqs for t in (*s.prompt_ids, *s.token_ids[:-1])], dtype=torch.int64,
                       device=device)
    ctx = PackedContext([s.input_len for s in seqs], device)
    hidden = model.hidden(ids, ctx.positions, ctx, ops)
    rows, targets, temps, truncs = [], [], [], []
    start = 0
    for s in seqs:
        first = start + len(s.prompt_ids) - 1
        rows.append(torch.arange(first, first + len(s.token_ids)))
        targets.extend(s.token_ids)
        temps.extend([s.temperature] * len(s.token_ids))
        truncs.extend([s.truncation] * len(s.token_ids))
        start += s.input_len
    row_idx = torch.cat(rows).to(device)
    args = (hidden[row_idx], torch.tensor(temps, dtype=torch.float32, device=device),
            torch.tensor(targets, dtype=torch.int64, device=device), ops, RowTruncation.of(truncs, device))
    sizes = [len(s.token_ids) for s in seqs]
    if entropy is None:
        return list(model.token_logprobs(*args).split(sizes))
    tok, ent = model.token_logprobs_entropy(*args)
    entropy.extend(ent.split(sizes))
    return list(tok.split(sizes))


def sequence_logprobs(model: CausalLM, seqs: Sequence[ScoredSequence], *, pack_tokens: int = 4096,
                      ops: Backend | None = None) -> list[Tensor]:
    """Token logprobs of every sequence, packed ``pack_tokens`` rows at a time (autograd follows
    the caller's grad mode)."""
    vocab = model.config.vocab_size
    for i, s in enumerate(seqs):
        bad = [t for t in (*s.prompt_ids, *s.token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sequence {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if s.input_len > model.config.max_position_embeddings:
            raise ValueError(f"sequence {i}: {s.input_len} positions exceed max_position_embeddings="
                             f"{model.config.max_position_embeddings}")
    out: list[Tensor] = [torch.empty(0)] * len(seqs)
    for group in pack(seqs, pack_tokens):
        for i, lp in zip(group, pack_logprobs(model, [seqs[i] for i in group], ops), strict=True):
            out[i] = lp
    return out
