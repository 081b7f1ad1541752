"""Rollout throughput: our engine (consistent vs fast kernels) vs transformers' cached ``generate``,
and the logdiff of transformers' cached decode against its own full forward, beside ours."""

from __future__ import annotations

import time

import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.checkpoint import LoadedModel
from onpolicy.models.registry import load_model
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .common import Report, Result, log, median_time
from .hf import hf_model


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (batch, prompt_len), generator=g).tolist()


def engine_tokens_per_s(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    need = len(prompts) * (len(prompts[0]) + new_tokens)
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=len(prompts), max_batched_tokens=max(2048, len(prompts)),
                                            kv_cache_tokens=need + 64 * len(prompts), prefix_cache=False))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    t = median_time(lambda: engine.generate(prompts, params), repeats)
    return len(prompts) * new_tokens / t


def hf_tokens_per_s(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    ids = torch.tensor(prompts)

    def run() -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)

    return len(prompts) * new_tokens / median_time(run, repeats)


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


def our_logdiff(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=len(prompts)))
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature)
                                               for c in comps])
    return max(float((torch.tensor(c.logprobs) - t).abs().max()) for c, t in zip(comps, trainer, strict=True))


def run_rollout(model: str, dtypes: list[str], batches: list[int], prompt_len: int, new_tokens: int,
                repeats: int, with_hf: bool = True) -> Report:
    report = Report(command=f"onpolicy bench rollout --model {model}")
    logdiffs: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        cons = load_model(model, get_backend(KernelConfig(compute_dtype=dtype)))
        fast = load_model(model, get_backend(KernelConfig(backend="fast", compute_dtype=dtype)))
        hf = hf_model(cons, cons.model.dtype) if with_hf else None
        for bs in batches:
            prompts = prompts_for(bs, prompt_len, cons.config.vocab_size)
            t0 = time.perf_counter()
            c = engine_tokens_per_s(cons, prompts, new_tokens, repeats)
            f = engine_tokens_per_s(fast, prompts, new_tokens, repeats)
            report.results.append(Result(f"overhead/rollout/bs{bs}/{dtype}", c, f, "tokens/s",
                                         "consistent vs fast, same engine"))
            if hf is not None:
                h = hf_tokens_per_s(hf, prompts, new_tokens, repeats)
                report.results.append(Result(f"vs-hf/rollout/bs{bs}/{dtype}", c, h, "tokens/s",
                                             "consistent vs transformers generate"))
            log(f"{dtype} bs{bs}: done in {time.perf_counter() - t0:.0f}s")
        prompts = prompts_for(4, prompt_len, cons.config.vocab_size, seed=1)
        logdiffs[dtype] = {"ours_consistent": our_logdiff(cons, prompts, new_tokens),
                           "ours_fast": our_logdiff(fast, prompts, new_tokens)}
        if hf is not None:
            logdiffs[dtype]["transformers_cached_vs_full"] = hf_cached_logdiff(hf, prompts, new_tokens)
    report.extra["max_abs_logdiff"] = logdiffs
    report.extra["setup"] = {"prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
                             "sampling": "greedy, ignore eos"}
    return report
