"""The batch-invariance suite for any rollout engine (``onpolicy consistency --engine vllm``).

The checks of vLLM's own batch-invariance tests, pointed at an ``Engine`` built by a factory (a vLLM
engine starts in tens of seconds, so the suite needs only two):

* **bs1 vs bsN** — each target alone, then in a batch among random fillers at a random position;
* **prefix cache cold vs hot** — the targets again on the same engine, their prefixes now cached;
* **chunked prefill** — the targets on a second engine with a small ``max_batched_tokens``;
* **decode vs prefill** — every completion recomputed on the training path (one prefill-style
  forward per packing), compared bit for bit with the engine's decode-time logprobs.

The report is ``consistency.ConsistencyReport``; a check that gives other tokens or logprobs than
the alone run counts as a schedule mismatch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import Completion, EngineConfig, SamplingParams
from onpolicy.rollout.interface import Engine

from .consistency import ConsistencyReport, ScheduleResult, build_prompts, trainer_path_stats


def _same(a: list[Completion], b: list[Completion]) -> bool:
    return all(x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in zip(a, b, strict=True))


def run_batch_invariance(make_engine: Callable[[EngineConfig], Engine], trainer_lm: LoadedModel, *,
                         requests: int = 8, fillers: int = 31, max_new_tokens: int = 16, seed: int = 0,
                         chunk_tokens: int = 16, log: Callable[[str], None] | None = None) -> ConsistencyReport:
    """Run the suite; ``trainer_lm`` is the model the training path recomputes on (its fingerprint
    is the report's)."""
    say = log or (lambda _m: None)
    rng = random.Random(seed)
    targets = build_prompts(trainer_lm, requests, rng)
    vocab = trainer_lm.config.vocab_size
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    report = ConsistencyReport(trainer_lm.name, trainer_lm.model.ops.fingerprint, requests)
    longest = max(len(p) for p in targets) + 80 + max_new_tokens
    kv = (fillers + 1) * (longest + 128)
    runs: list[list[Completion]] = []

    def record(name: str, cfg: EngineConfig, comps: list[Completion], ref: list[Completion] | None,
               t0: float) -> None:
        same = ref is None or _same(comps, ref)
        report.schedule_mismatches += 0 if same else 1
        res = ScheduleResult(name, asdict(cfg), False, len(comps), sum(len(c.token_ids) for c in comps), same,
                             round(time.perf_counter() - t0, 2))
        report.schedules.append(res)
        runs.append(comps)
        say(f"{name}: {res.tokens} tokens in {res.seconds:.1f}s, identical to alone: {same}")

    cfg = EngineConfig(max_num_seqs=fillers + 1, kv_cache_tokens=kv)
    t0 = time.perf_counter()
    engine = make_engine(cfg)
    say(f"engine up in {time.perf_counter() - t0:.1f}s")
    try:
        t0 = time.perf_counter()
        alone = [replace(engine.generate([p], params)[0], prompt_index=i) for i, p in enumerate(targets)]
        record("alone (bs1)", cfg, alone, None, t0)
        t0 = time.perf_counter()
        batched = []
        for i, target in enumerate(targets):
            batch = [[rng.randrange(vocab) for _ in range(rng.randint(1, 80))] for _ in range(fillers)]
            at = rng.randrange(fillers + 1)
            batch.insert(at, target)
            batched.append(replace(engine.generate(batch, params)[at], prompt_index=i))
        record(f"bs{fillers + 1}, target at a random position", cfg, batched, alone, t0)
        t0 = time.perf_counter()
        hot = engine.generate(targets, params)
        record("prefix cache hot", cfg, hot, alone, t0)
    finally:
        engine.close()
    chunked_cfg = EngineConfig(max_num_seqs=8, max_batched_tokens=chunk_tokens, kv_cache_tokens=kv)
    engine = make_engine(chunked_cfg)
    try:
        t0 = time.perf_counter()
        record(f"chunked prefill (max_batched_tokens={chunk_tokens})", chunked_cfg,
               engine.generate(targets, params), alone, t0)
    finally:
        engine.close()
    report.packings = packings = [1, 4096]
    stats = trainer_path_stats(trainer_lm, runs, packings)
    say(f"decode vs prefill (trainer path): {stats.tokens_checked} tokens checked, {stats.mismatched_tokens} "
        f"mismatched, max |logdiff| {stats.max_abs_logdiff:.3g}")
    report.tokens_checked, report.mismatched_tokens = stats.tokens_checked, stats.mismatched_tokens
    report.max_abs_logdiff = stats.max_abs_logdiff
    return report
