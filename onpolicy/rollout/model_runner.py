"""``ModelRunner``: turns a ``SchedulerOutput`` into tensors, runs the model over the paged cache,
and samples the next token of every request whose chunk reached its end (from its logprobs after
its top-k / top-p / min-p truncation, which are the logprobs it reports). The only owner of tensors
in the rollout engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from onpolicy.kernels import AttentionBatch
from onpolicy.kernels.sampling import sample
from onpolicy.kernels.truncation import RowTruncation
from onpolicy.models.causal_lm import CausalLM

from .kv_cache import KVCache, PagedContext
from .scheduler import SchedulerOutput


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token: int
    logprob: float


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    @torch.no_grad()
    def run(self, out: SchedulerOutput) -> list[SampledToken]:
        device = self.model.device
        page = self.cache.page_size
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        for s in out.scheduled:
            stop = s.start + s.num_tokens
            ids.extend(s.seq.tokens[s.start:stop])
            positions.extend(range(s.start, stop))
            table = s.seq.block_table
            slots.extend(table[p // page] * page + p % page for p in range(s.start, stop))
        q_lens = [s.num_tokens for s in out.scheduled]
        starts = [s.start for s in out.scheduled]
        batch = AttentionBatch.build(q_lens, starts, [a + b for a, b in zip(starts, q_lens, strict=True)], device)
        width = max(len(s.seq.block_table) for s in out.scheduled)
        table = torch.tensor([[*s.seq.block_table, *[0] * (width - len(s.seq.block_table))] for s in out.scheduled],
                             dtype=torch.int64, device=device)
        ctx = PagedContext(self.cache, batch, table, torch.tensor(slots, dtype=torch.int64, device=device))
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        hidden = self.model.hidden(torch.tensor(ids, dtype=torch.int64, device=device), positions_t, ctx)
        sampled = [s for s in out.scheduled if s.samples]
        if not sampled:
            return []
        ends = [e - 1 for e in itertools.accumulate(q_lens)]
        rows = torch.tensor([ends[i] for i, s in enumerate(out.scheduled) if s.samples], dtype=torch.int64,
                            device=device)
        temps = torch.tensor([s.seq.params.logprob_temperature for s in sampled], dtype=torch.float32, device=device)
        trunc = RowTruncation.of([s.seq.params.truncation for s in sampled], device)
        lp = self.model.logprobs(hidden[rows], temps, truncation=trunc)
        keys = torch.tensor([s.seq.key for s in sampled], dtype=torch.int64, device=device)
        steps = torch.tensor([len(s.seq.generated) for s in sampled], dtype=torch.int64, device=device)
        greedy = torch.tensor([s.seq.params.greedy for s in sampled], device=device)
        tokens = sample(lp, keys, steps, greedy)
        token_lp = lp.gather(1, tokens[:, None])[:, 0]
        return [SampledToken(s.seq.seq_id, int(t), float(v))
                for s, t, v in zip(sampled, tokens.tolist(), token_lp.tolist(), strict=True)]
