"""The one-command proof: the same requests under many serving schedules, and every completion
recomputed on the training path under several packings, all compared bit for bit."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .logdiff import LogdiffStats, compare

QUESTIONS = [
    "What is the capital of France?", "What is 17 + 25?", "Name three primary colors.",
    "Write a haiku about the sea.", "What is 9 times 7?", "Explain gravity in one sentence.",
    "List the days of the week.", "What is the boiling point of water in Celsius?",
]


@dataclass
class ScheduleResult:
    name: str
    engine: dict[str, object]
    staggered: bool
    completions: int
    tokens: int
    identical_to_alone: bool
    seconds: float


@dataclass
class ConsistencyReport:
    model: str
    kernel_fingerprint: str
    requests: int
    tokens_checked: int = 0
    mismatched_tokens: int = 0
    max_abs_logdiff: float = 0.0
    schedule_mismatches: int = 0
    schedules: list[ScheduleResult] = field(default_factory=list)
    packings: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.mismatched_tokens == 0 and self.schedule_mismatches == 0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def build_prompts(lm: LoadedModel, count: int, rng: random.Random) -> list[list[int]]:
    """Prompts with shared prefixes: chat-formatted questions for models with a tokenizer, random
    ids (half of them sharing a long prefix) otherwise."""
    prompts: list[list[int]] = []
    if lm.tokenizer is not None:
        for i in range(count):
            q = QUESTIONS[i % len(QUESTIONS)]
            if i >= len(QUESTIONS):
                q = f"{q} Answer briefly (variant {i // len(QUESTIONS)})."
            prompts.append(lm.tokenizer.encode(lm.tokenizer.chat_prompt(q)))
        return prompts
    vocab = lm.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(80)]
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def trainer_path_stats(lm: LoadedModel, runs: list[list[Completion]], packings: list[int]) -> LogdiffStats:
    """Every run's completions recomputed on the training path of ``lm`` (run ``k`` packed at
    ``packings[k % len(packings)]`` tokens) and compared bit for bit with their logprobs."""
    stats = LogdiffStats()
    for comps, packing in zip(runs, packings * len(runs), strict=False):
        seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
        with torch.no_grad():
            trainer = sequence_logprobs(lm.model, seqs, pack_tokens=packing)
        stats.merge(compare([torch.tensor(c.logprobs, dtype=torch.float32) for c in comps], trainer))
    return stats


def _run(lm: LoadedModel, prompts: list[list[int]], params: SamplingParams, cfg: EngineConfig,
         stagger: random.Random | None) -> list[Completion]:
    engine = RolloutEngine(lm, cfg)
    if stagger is None:
        return engine.generate(prompts, params)
    pending = list(enumerate(prompts))
    stagger.shuffle(pending)
    done: list[Completion] = []
    while pending or engine.has_unfinished():
        for _ in range(stagger.randint(0, 3) if engine.has_unfinished() else 1):
            if pending:
                i, p = pending.pop()
                engine.add_request(p, params, prompt_index=i)
        if engine.has_unfinished():
            done.extend(engine.step())
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))


def run_consistency(lm: LoadedModel, *, requests: int = 16, max_new_tokens: int = 48, seed: int = 0,
                    schedules: int = 3, log: Callable[[str], None] | None = None) -> ConsistencyReport:
    rng = random.Random(seed)
    prompts = build_prompts(lm, requests, rng)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=1, seed=seed)
    report = ConsistencyReport(lm.name, lm.model.ops.fingerprint, requests)
    page = lm.model.ops.config.kv_tile
    say = log or (lambda _m: None)

    def record(name: str, cfg: EngineConfig, staggered: bool, comps: list[Completion], t0: float,
               ref: list[Completion] | None) -> None:
        same = ref is None or all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
                                  for a, b in zip(ref, comps, strict=True))
        if not same:
            report.schedule_mismatches += 1
        res = ScheduleResult(name, {k: v for k, v in asdict(cfg).items()}, staggered, len(comps),
                             sum(len(c.token_ids) for c in comps), same, round(time.perf_counter() - t0, 2))
        report.schedules.append(res)
        say(f"schedule {name}: {res.tokens} tokens in {res.seconds:.1f}s, identical to alone: {same}")

    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts) + max_new_tokens
    alone_cfg = EngineConfig(max_num_seqs=1, prefix_cache=False, kv_cache_tokens=longest + 2 * page)
    alone = [_run(lm, [p], params, alone_cfg, None)[0] for p in prompts]
    alone = [replace(c, prompt_index=i) for i, c in enumerate(alone)]
    record("alone", alone_cfg, False, alone, t0, None)
    need = sum(len(p) + max_new_tokens + 2 * page for p in prompts)
    runs = [("together", EngineConfig(kv_cache_tokens=need), None)]
    for k in range(schedules):
        cfg = EngineConfig(max_num_seqs=rng.choice([2, 3, 5, 8]), max_batched_tokens=rng.choice([7, 16, 33, 64, 100]),
                           page_size=page * rng.choice([1, 2]), prefix_cache=bool(k % 2 == 0),
                           kv_cache_tokens=max(4 * longest, need // rng.choice([1, 2, 4])))
        runs.append((f"random-{k}", cfg, random.Random(seed * 1000 + k)))
    all_runs = [alone]
    for name, cfg, stagger in runs:
        t0 = time.perf_counter()
        comps = _run(lm, prompts, params, cfg, stagger)
        record(name, cfg, stagger is not None, comps, t0, alone)
        all_runs.append(comps)
    # every schedule's completions on the training path, under several packings
    packings = [1, rng.randint(20, 200), 4096]
    report.packings = packings
    stats = trainer_path_stats(lm, all_runs, packings)
    say(f"trainer path: {stats.tokens_checked} tokens checked, {stats.mismatched_tokens} mismatched, "
        f"max |logdiff| {stats.max_abs_logdiff:.3g}")
    report.tokens_checked, report.mismatched_tokens = stats.tokens_checked, stats.mismatched_tokens
    report.max_abs_logdiff = stats.max_abs_logdiff
    return report
