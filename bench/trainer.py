"""Our trainer path's forward+backward throughput, and one GRPO step with and without the
old-logprob recompute pass (``TrainerEngine.train_step(recompute_old=...)``)."""

from __future__ import annotations

import statistics

import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import SamplingParams
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainSample
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .common import median_time
from .rollout import engine_for


def train_seconds(lm: LoadedModel, seqs: list[list[int]], repeats: int) -> float:
    """Median wall time of one forward+backward of the training path over ``seqs`` (teacher-forced
    logprob of every next token, one packed forward; their sum as the loss)."""
    scored = [ScoredSequence(tuple(s[:1]), tuple(s[1:])) for s in seqs]
    model = lm.model
    model.requires_grad_(True)

    def run() -> None:
        lp = sequence_logprobs(model, scored, pack_tokens=sum(len(s) for s in seqs))
        (-torch.cat(lp).sum()).backward()
        model.zero_grad(set_to_none=True)

    try:
        return median_time(run, repeats)
    finally:
        model.requires_grad_(False)


def grpo_samples(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> list[TrainSample]:
    """Sampled completions (temperature 1) with their rollout logprobs and ±1 advantages."""
    engine = engine_for(lm, len(prompts), len(prompts[0]) + new_tokens)
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))
    return [TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=tuple(c.logprobs),
                        advantage=1.0 if i % 2 else -1.0) for i, c in enumerate(comps)]


def rl_step_times(trainer_lm: LoadedModel, samples: list[TrainSample], repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of a GRPO step without and with the recompute, and their parts (the recompute
    pass; the policy update = forward+backward+AdamW). Steps alternate so both see the same load."""
    engine = TrainerEngine(trainer_lm)
    loss, opt = LossConfig(), OptimizerConfig(lr=1e-7)
    engine.train_step(samples, loss, opt)  # warm-up (and the optimizer state)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(repeats):
        for recompute in (False, True):
            st = engine.train_step(samples, loss, opt, recompute_old=recompute)
            runs[recompute].append((st.seconds, st.recompute_seconds))
    out = {}
    for recompute, key in ((False, "no_recompute"), (True, "recompute")):
        total = statistics.median(t for t, _ in runs[recompute])
        rec = statistics.median(r for _, r in runs[recompute])
        out[key] = {"step_s": total, "recompute_s": rec, "policy_update_s": total - rec}
    return out
