"""``RolloutEngine``: requests in, completions out — the step loop joining scheduler, block manager
and model runner, with weight updates that invalidate the prefix cache, and (``speculative``) n-gram
drafts verified in the same forward, rejected ones rolled back (``onpolicy.rollout.speculative``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel, copy_weights_, weights_sha256

from .block_manager import BlockManager
from .interface import EngineSnapshot, generate, validate_request
from .kv_cache import KVCache
from .model_runner import ModelRunner, SampledToken
from .scheduler import Scheduler
from .sequence import Completion, SamplingParams, Sequence
from .speculative import SpeculativeConfig, propose_ngram
from .step_clock import StepClock


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_num_seqs: int = 32
    """Most requests in the running batch at once."""
    max_batched_tokens: int = 2048
    """Most token rows computed in one step (prefill chunks + decodes)."""
    page_size: int | None = None
    """Positions per KV page; a multiple of the KV tile (default: the KV tile)."""
    kv_cache_tokens: int = 16384
    """KV cache capacity in token positions (fixed memory budget, allocated up front; SmolLM2-135M
    needs 46 KiB per position in fp32, so the default is ~0.75 GiB)."""
    prefix_cache: bool = True
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (default off); the same tokens and logprob bits either way."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "kv_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    seconds: float = 0.0
    spec_drafted: int = 0
    spec_accepted: int = 0


class RolloutEngine:
    """Our own engine (``Engine``): scheduler, block manager and model runner on the operator set."""

    name = "onpolicy"

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None) -> None:
        self.lm = lm
        self.config = config or EngineConfig()
        kv_tile = lm.model.ops.config.kv_tile
        page = self.config.page_size or kv_tile
        if page % kv_tile:
            raise ValueError(f"page_size {page} must be a multiple of the KV tile {kv_tile}")
        cfg = lm.config
        num_pages = max(1, self.config.kv_cache_tokens // page)
        # a tensor-parallel model holds (and caches) only its rank's KV heads; stand-ins for the model
        # (the doctor's capturing tap) are unsharded
        kv_heads = getattr(lm.model, "num_local_kv_heads", cfg.num_kv_heads)
        self.cache = KVCache(cfg.num_layers, num_pages, page, kv_heads, cfg.head_dim, lm.model.dtype, lm.model.device)
        self.blocks = BlockManager(num_pages, page, self.config.prefix_cache)
        drafter = self._draft if self.config.speculative.enabled else None
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_batched_tokens, drafter)
        self.clock = StepClock()
        """Where the steps' time went, per phase (``onpolicy.rollout.step_clock``)."""
        self.runner = ModelRunner(lm.model, self.cache, stack=lm.model.dense_stack(),  # compiled once, here
                                  clock=self.clock)
        self.weight_version = 0
        self.counters = EngineStats()
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_pages * self.blocks.page_size

    @property
    def kernel_config(self) -> KernelConfig:
        return self.lm.model.ops.config

    @property
    def fingerprint(self) -> str:
        return self.kernel_config.fingerprint

    @property
    def failed(self) -> str:
        return ""

    def close(self) -> None:
        """Nothing to end: the engine lives in this process."""

    def stats(self) -> EngineSnapshot:
        c, sched, blocks = self.counters, self.scheduler, self.blocks
        used = sum(1 for r in list(blocks.ref) if r > 0)
        return EngineSnapshot(steps=c.steps, tokens_computed=c.tokens_computed, tokens_generated=c.tokens_generated,
                              seconds=c.seconds, waiting=len(sched.waiting), running=len(sched.running),
                              kv_usage=used / blocks.num_pages, prefix_cache_hits=blocks.hits,
                              preemptions=sched.num_preemptions, spec_drafted=c.spec_drafted,
                              spec_accepted=c.spec_accepted)

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(self.lm.config, self.capacity_tokens, prompt_ids, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list[int]:
        """Queue ``params.n`` samples of one prompt; returns their sequence ids."""
        self.validate(prompt_ids, params)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.lm.eos_token_ids)
        ids = []
        for i in range(params.n):
            seq = Sequence(self._next_id, prompt_index, i, tuple(prompt_ids), params, frozenset(stop))
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
            ids.append(seq.seq_id)
            self._next_id += 1
        return ids

    def abort(self, seq_ids: Iterable[int]) -> int:
        """Drop the unfinished sequences among ``seq_ids`` (a cancelled request), freeing their KV
        pages; finished or unknown ids are ignored. Returns how many were dropped."""
        dropped = [self._seqs.pop(i) for i in seq_ids if i in self._seqs]
        for seq in dropped:
            self.scheduler.abort(seq)
        return len(dropped)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Completion]:
        """One engine step; returns the completions that finished in it."""
        t0 = time.perf_counter()
        self.clock.start()
        out = self.scheduler.schedule()
        self.clock.lap("schedule")
        if not out.scheduled:
            raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
        sampled = self.runner.run(out)
        emitted: dict[int, list[SampledToken]] = {}
        for tok in sampled:
            emitted.setdefault(tok.seq_id, []).append(tok)
        done: list[Completion] = []
        appended = 0
        for s in out.scheduled:
            seq = s.seq
            reason = None
            for tok in emitted.get(seq.seq_id, ()):
                seq.tokens.append(tok.token)
                seq.logprobs.append(tok.logprob)
                appended += 1
                reason = self._finish_reason(seq, tok.token)
                if reason:
                    break
            if s.draft:  # every position but the last token's now holds the K/V of an emitted token
                seq.num_computed = len(seq.tokens) - 1
                self.counters.spec_drafted += len(s.draft)
                self.counters.spec_accepted += len(emitted[seq.seq_id]) - 1
            else:
                seq.num_computed = s.start + s.num_tokens
            self.blocks.register_full_pages(seq)
            if reason:
                self.scheduler.finish(seq, reason)
                done.append(self._completion(seq))
                del self._seqs[seq.seq_id]
            elif s.draft:
                self.blocks.shrink(seq, len(seq.tokens))
        self.clock.lap("update")
        self.counters.steps += 1
        self.counters.tokens_computed += out.num_tokens
        self.counters.tokens_generated += appended
        self.counters.seconds += time.perf_counter() - t0
        return done

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if len(seq.generated) >= seq.params.max_new_tokens or len(seq.tokens) >= self.lm.config.max_position_embeddings:
            return "length"
        return None

    def _draft(self, seq: Sequence) -> list[int]:
        """The n-gram draft of a decoding ``seq``, no longer than what it may still emit (the token
        after the draft is always emitted) nor past the model's last position."""
        spec = self.config.speculative
        k = min(spec.num_tokens, seq.params.max_new_tokens - len(seq.generated) - 1,
                self.lm.config.max_position_embeddings - len(seq.tokens))
        return propose_ngram(seq.tokens, k, spec.ngram_min, spec.ngram_max)

    def _completion(self, seq: Sequence) -> Completion:
        return Completion(prompt_index=seq.prompt_index, sample_index=seq.sample_index, prompt_ids=seq.prompt_ids,
                          token_ids=tuple(seq.generated), logprobs=tuple(seq.logprobs),
                          finish_reason=seq.finish_reason or "length", weight_version=self.weight_version,
                          temperature=seq.params.logprob_temperature, **seq.params.truncation.to_dict())

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams,
                 progress: Callable[[EngineSnapshot, int, int], None] | None = None) -> list[Completion]:
        """Run prompts to completion; completions come back ordered by (prompt, sample index)."""
        return generate(self, prompts, params, progress)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights (same names and shapes) and drop the now-stale prefix cache."""
        if self.has_unfinished():
            raise RuntimeError("cannot update weights while requests are in flight")
        copy_weights_(self.lm.model, state)
        self.lm.weights_sha256 = self._served_sha256(state)
        self.reset_prefix_cache()
        self.weight_version = version

    def _served_sha256(self, state: dict[str, torch.Tensor]) -> str:
        """The checksum of the weights now served: the model's own (``state`` cast to its dtype)."""
        return weights_sha256(self.lm.model.state_dict())
