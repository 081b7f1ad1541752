"""``ModelRunner``: turns a ``SchedulerOutput`` into tensors, runs the model over the paged cache,
and samples the next token of every request whose chunk reached its end (from its logprobs after
its top-k / top-p / min-p truncation, which are the logprobs it reports). A request with drafted
tokens (speculative decoding) is sampled at its last token's row and at every drafted row, each with
its own step, and keeps the accepted drafts plus the sampler's next token
(``onpolicy.rollout.speculative``). The only owner of tensors in the rollout engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from onpolicy.kernels import AttentionBatch
from onpolicy.kernels.backend import DenseStack
from onpolicy.kernels.sampling import sample
from onpolicy.kernels.truncation import RowTruncation
from onpolicy.models.causal_lm import CausalLM

from .kv_cache import KVCache, PagedContext
from .scheduler import ScheduledSeq, SchedulerOutput
from .speculative import accept
from .step_clock import StepClock


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token: int
    logprob: float


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, stack: DenseStack | None = None,
                 clock: StepClock | None = None) -> None:
        """``stack``: the model's layers as one native call (``CausalLM.dense_stack``), chosen once by
        the engine at load time; None runs the layers one by one (the same bits). ``clock``: the
        engine's, charged with the phases of :meth:`run` (its own when not given)."""
        self.model, self.cache, self.stack = model, cache, stack
        self.clock = clock or StepClock()

    @torch.no_grad()
    def run(self, out: SchedulerOutput) -> list[SampledToken]:
        """The tokens to append, in order: one per sampled request, or, for a request with a draft,
        its accepted drafted tokens and then the sampler's next token."""
        device = self.model.device
        page = self.cache.page_size
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        for s in out.scheduled:
            stop = s.start + s.num_tokens
            ids.extend(s.seq.tokens[s.start:stop - len(s.draft)])
            ids.extend(s.draft)
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
        ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
        self.clock.lap("inputs")
        hidden = self.model.hidden(ids_t, positions_t, ctx, stack=self.stack)
        self.clock.lap("layers")
        ends = [e - 1 for e in itertools.accumulate(q_lens)]
        sampled = [(s, end) for s, end in zip(out.scheduled, ends, strict=True) if s.samples]
        if not sampled:
            return []
        # one row per sampled position: the last token's row, then each drafted row (step + j)
        rows_of = [(s, end - len(s.draft) + j, j) for s, end in sampled for j in range(len(s.draft) + 1)]
        params = [s.seq.params for s, _, _ in rows_of]
        rows = torch.tensor([r for _, r, _ in rows_of], dtype=torch.int64, device=device)
        temps = torch.tensor([p.logprob_temperature for p in params], dtype=torch.float32, device=device)
        trunc = RowTruncation.of([p.truncation for p in params], device)
        lp = self.model.logprobs(hidden[rows], temps, truncation=trunc)
        self.clock.lap("head")
        keys = torch.tensor([s.seq.key for s, _, _ in rows_of], dtype=torch.int64, device=device)
        steps = torch.tensor([len(s.seq.generated) + j for s, _, j in rows_of], dtype=torch.int64, device=device)
        greedy = torch.tensor([p.greedy for p in params], device=device)
        tokens = sample(lp, keys, steps, greedy)
        token_lp = lp.gather(1, tokens[:, None])[:, 0]
        emitted = _emit([s for s, _ in sampled], tokens.tolist(), token_lp.tolist())
        self.clock.lap("sample")
        return emitted


def _emit(sampled: list[ScheduledSeq], tokens: list[int], logprobs: list[float]) -> list[SampledToken]:
    """Each sampled request's tokens: its accepted drafts and the sampler's token after them."""
    out: list[SampledToken] = []
    i = 0
    for s in sampled:
        width = len(s.draft) + 1
        keep = accept(s.draft, tokens[i:i + width]) + 1
        out.extend(SampledToken(s.seq.seq_id, t, v)
                   for t, v in zip(tokens[i:i + keep], logprobs[i:i + keep], strict=True))
        i += width
    return out
