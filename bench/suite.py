"""The benchmark suites behind ``onpolicy bench {vs-vllm,vs-hf,roofline,rl-step,all}``: what each
measures, at which sizes (``Setup``: full or ``--quick``), on models loaded once per run
(``Workbench``). Every ratio is measured side by side in one run, the engines alternating."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.config import dtype_of
from onpolicy.models.loading import LoadedModel
from onpolicy.models.registry import load_model

from . import hf, roofline, vs_vllm
from .common import Report, Result, alternating, log
from .rollout import DecodeRate, decode_rate, generate_seconds, our_logdiff, prompts_for, sampled_logdiff
from .trainer import grpo_samples, rl_step_times, train_seconds

SUITES = ("vs-vllm", "vs-hf", "roofline", "rl-step")


@dataclass(frozen=True)
class Setup:
    """Sizes of one run. Rollout: equally long random prompts, greedy, EOS ignored, exactly
    ``new_tokens`` generated per sequence. Trainer: ``train_batch`` sequences of ``train_len`` tokens."""

    dtypes: tuple[str, ...] = ("fp32", "bf16")
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 64
    new_tokens: int = 128
    repeats: int = 1
    """Timed runs of each rollout measurement (after a short warm-up); the median is reported."""
    rounds: int = 1
    """Side-by-side measurements (rollout and trainer) are taken this many times, the engines
    alternating within each round, and each engine's median throughput is reported: on a machine
    whose speed drifts, every engine then sees the same drift."""
    train_batch: int = 4
    train_len: int = 256
    train_repeats: int = 2
    decode_tokens: int = 32
    """Decode steps of the roofline's decode-only rate."""
    logdiff_tokens: int = 32
    rl_batch: int = 4
    rl_new_tokens: int = 32
    bandwidth_mib: int = 512
    vllm_dtypes: tuple[str, ...] = ("fp32", "bf16")
    vllm_batches: tuple[int, ...] = (1, 8, 32, 64)
    vllm_rounds: int = 3
    """vs-vllm's own sizes (``--dtype``, ``--batches`` and ``--rounds`` set them with the others')."""
    vllm_eager: bool = False
    """vLLM without ``torch.compile``: starts in seconds instead of minutes (``--quick`` sets it)."""

    @staticmethod
    def quick() -> Setup:
        return Setup(dtypes=("fp32",), batches=(1, 32), prompt_len=32, new_tokens=16, train_batch=4, train_len=64,
                     decode_tokens=8, logdiff_tokens=8, rl_batch=4, rl_new_tokens=8, bandwidth_mib=256,
                     vllm_batches=(1, 32), vllm_eager=True)

    def with_(self, **changes: object) -> Setup:
        return replace(self, **changes)  # type: ignore[arg-type]


class Workbench:
    """One model, loaded once per (backend, dtype), its transformers twin per dtype, and measurements
    that suites share."""

    def __init__(self, model: str, setup: Setup) -> None:
        self.model, self.setup = model, setup
        self._models: dict[tuple[str, str], LoadedModel] = {}
        self._hf: dict[str, torch.nn.Module] = {}
        self._memo: dict[tuple[object, ...], float] = {}
        self.engines: set[str] = set()  # engines whose throughput the selected suites compare

    def lm(self, backend: str, dtype: str) -> LoadedModel:
        key = (backend, dtype)
        if key not in self._models:
            self._models[key] = load_model(self.model, get_backend(KernelConfig(backend=backend, compute_dtype=dtype)))
        return self._models[key]

    def fresh_lm(self, dtype: str) -> LoadedModel:
        """A consistent model of its own (a trainer changes its weights)."""
        return load_model(self.model, get_backend(KernelConfig(compute_dtype=dtype)))

    def hf(self, dtype: str) -> torch.nn.Module:
        if dtype not in self._hf:
            self._hf[dtype] = hf.hf_model(self.lm("reference", dtype), dtype_of(dtype))
        return self._hf[dtype]

    def vocab(self) -> int:
        return self.lm("reference", self.setup.dtypes[0]).config.vocab_size

    # ------------------------------------------------------------------ shared measurements
    def rollout_tps(self, engine: str, dtype: str, batch: int) -> float:
        """Tokens/s of ``engine`` (reference | hf) generating ``new_tokens`` for ``batch`` prompts.
        Every engine of ``self.engines`` is measured at once, back to back, so their ratios see the
        same machine load."""
        s = self.setup
        prompts = prompts_for(batch, s.prompt_len, self.vocab())

        def measure(name: str) -> float:
            if name == "hf":
                secs = hf.hf_generate_seconds(self.hf(dtype), prompts, s.new_tokens, s.repeats)
            else:
                secs = generate_seconds(self.lm(name, dtype), prompts, s.new_tokens, s.repeats)
            return batch * s.new_tokens / secs

        return self._side_by_side(("rollout", dtype, batch), engine, measure)

    def train_tps(self, engine: str, dtype: str) -> float:
        """Tokens/s of one forward+backward over ``train_batch`` sequences of ``train_len`` tokens
        (every engine of ``self.engines`` back to back, as for the rollout)."""
        s = self.setup
        seqs = prompts_for(s.train_batch, s.train_len, self.vocab(), seed=2)

        def measure(name: str) -> float:
            if name == "hf":
                secs = hf.hf_train_seconds(self.hf(dtype), seqs, s.train_repeats)
            else:
                secs = train_seconds(self.lm(name, dtype), seqs, s.train_repeats)
            return s.train_batch * (s.train_len - 1) / secs

        return self._side_by_side(("train", dtype), engine, measure)

    def _side_by_side(self, key: tuple[object, ...], engine: str, measure: Callable[[str], float]) -> float:
        if (*key, engine) not in self._memo:
            names = sorted(self.engines | {engine})
            runs = alternating({name: lambda name=name: measure(name) for name in names}, self.setup.rounds)
            for name in names:
                self._memo[(*key, name)] = statistics.median(runs[name])
        return self._memo[(*key, engine)]


# ---------------------------------------------------------------------- suites
def vs_vllm_suite(wb: Workbench, report: Report) -> None:
    """Our engine (consistent kernels) vs vLLM's CPU engine as shipped (``bench/vs_vllm.py``): rollout
    tokens/s per batch size and dtype in alternating rounds (medians), and both engines' max
    |logdiff| against our trainer. Reported as skipped, with the reason, where vLLM cannot run."""
    s = wb.setup
    reason = vs_vllm.unavailable(wb.lm("reference", s.vllm_dtypes[0]))
    if reason:
        report.details.setdefault("skipped", {})["vs-vllm"] = reason
        log(f"vs-vllm skipped: {reason}")
        return
    info: dict[str, object] = {"loadavg_before": list(os.getloadavg())}
    rounds: dict[str, dict[str, list[float]]] = {}
    logdiffs: dict[str, dict[str, float]] = {}
    tokens_per_seq = s.prompt_len + max(s.new_tokens, s.logdiff_tokens)
    for dtype in s.vllm_dtypes:
        lm = wb.lm("reference", dtype)
        engine = vs_vllm.StockVllm(wb.model, lm, dtype, max(s.vllm_batches), tokens_per_seq, eager=s.vllm_eager)
        try:
            info["vllm"] = engine.info()
            for bs in s.vllm_batches:
                prompts = prompts_for(bs, s.prompt_len, wb.vocab())
                runs = vs_vllm.rounds_tokens_per_s(lm, engine, prompts, s.new_tokens, s.repeats, s.vllm_rounds)
                rounds[f"bs{bs}/{dtype}"] = runs
                med = vs_vllm.medians(runs)
                report.results.append(Result(f"vs-vllm/rollout/bs{bs}/{dtype}", med["ours"], med["vllm"], "tokens/s",
                                             "consistent / vLLM CPU (its own kernels), median of alternating rounds"))
                log(f"vs-vllm/rollout/bs{bs}/{dtype} done")
            prompts, n = prompts_for(4, s.prompt_len, wb.vocab(), seed=1), s.logdiff_tokens
            logdiffs[dtype] = {"ours": our_logdiff(lm, prompts, n), "vllm": sampled_logdiff(engine, lm, prompts, n)}
        finally:
            engine.close()
    info["loadavg_after"] = list(os.getloadavg())
    report.details["vs_vllm"] = {**info, "max_abs_logdiff": logdiffs, "rounds_tokens_s": rounds,
                                 "rounds": s.vllm_rounds, "dtypes": list(s.vllm_dtypes),
                                 "batches": list(s.vllm_batches)}


def vs_hf(wb: Workbench, report: Report) -> None:
    """Our consistent engines vs transformers: cached ``generate`` (greedy) and forward+backward; plus
    the logdiffs of both against their own training/full forward."""
    s = wb.setup
    logdiffs: dict[str, dict[str, float]] = {}
    for dtype in s.dtypes:
        for bs in s.batches:
            report.results.append(Result(f"vs-hf/rollout/bs{bs}/{dtype}", wb.rollout_tps("reference", dtype, bs),
                                         wb.rollout_tps("hf", dtype, bs), "tokens/s",
                                         "consistent / transformers generate"))
            log(f"vs-hf/rollout/bs{bs}/{dtype} done")
        report.results.append(Result(f"vs-hf/trainer/{dtype}", wb.train_tps("reference", dtype),
                                     wb.train_tps("hf", dtype), "tokens/s", "consistent / transformers, fwd+bwd"))
        prompts, n = prompts_for(4, s.prompt_len, wb.vocab(), seed=1), s.logdiff_tokens
        logdiffs[dtype] = {"ours_consistent": our_logdiff(wb.lm("reference", dtype), prompts, n),
                           "ours_fast": our_logdiff(wb.lm("fast", dtype), prompts, n),
                           "transformers_cached_vs_full": hf.hf_cached_logdiff(wb.hf(dtype), prompts, n)}
    report.details["max_abs_logdiff"] = logdiffs


def roofline_suite(wb: Workbench, report: Report) -> None:
    """Measured bandwidth -> batch-1 decode bound; measured GEMM peak -> large-batch compute bound.
    The bandwidth and the batch-1 decode are measured back to back, ``rounds`` times; the round with
    the median ratio is reported."""
    s = wb.setup
    bandwidths: list[float] = []
    info: dict[str, object] = {}
    big = max(s.batches)
    for dtype in s.dtypes:
        lm = wb.lm("reference", dtype)
        weight_bytes = roofline.decode_weight_bytes(lm.model)
        flops = roofline.gemm_flops(torch.float32, 1024, 5)  # our bf16 kernels widen to fp32 and run fp32 FMAs
        per_token = 2 * roofline.matmul_params(lm.model)

        def ours(batch: int, lm: LoadedModel = lm) -> DecodeRate:
            return decode_rate(lm, prompts_for(batch, s.prompt_len, wb.vocab(), seed=3), s.decode_tokens, s.repeats)

        pairs = [(roofline.read_bandwidth(s.bandwidth_mib, 5), ours(1)) for _ in range(s.rounds)]
        bandwidths += [bw for bw, _ in pairs]
        # the round whose ratio is the median (the lower one of an even count): a ratio of its own pair
        bw, one = sorted(pairs, key=lambda p: p[1].tokens_per_s * weight_bytes / p[0])[(len(pairs) - 1) // 2]
        bound1 = bw / weight_bytes
        report.results.append(Result(f"roofline/decode/bs1/{dtype}", one.tokens_per_s, bound1, "tokens/s",
                                     "decode-only / (bandwidth / weight bytes), the median round"))
        many = ours(big)
        report.results.append(Result(f"roofline/decode/bs{big}/{dtype}", many.tokens_per_s, flops / per_token,
                                     "tokens/s", "decode-only / (GEMM peak / 2 flops per weight)"))
        info[dtype] = {"decode_weight_bytes": weight_bytes, "gemm_gflop_s": flops / 1e9,
                       "flops_per_token": per_token, "bs1_bound_tokens_s": bound1,
                       "bs1_rounds": [{"read_bandwidth_gb_s": bw / 1e9, "decode_tokens_s": r.tokens_per_s}
                                      for bw, r in pairs],
                       "decode_step_ms": {"bs1": one.step_ms, f"bs{big}": many.step_ms}}
        log(f"roofline/{dtype} done")
    report.details["roofline"] = {"read_bandwidth_gb_s": statistics.median(bandwidths) / 1e9, **info}


def rl_step(wb: Workbench, report: Report) -> None:
    """One GRPO step (consistent kernels) with and without recomputing the old logprobs."""
    s = wb.setup
    breakdown: dict[str, object] = {}
    for dtype in s.dtypes:
        prompts = prompts_for(s.rl_batch, s.prompt_len, wb.vocab(), seed=4)
        samples = grpo_samples(wb.lm("reference", dtype), prompts, s.rl_new_tokens)
        times = rl_step_times(wb.fresh_lm(dtype), samples, max(1, s.train_repeats))
        report.results.append(Result(f"rl-step/no-recompute/{dtype}", 1 / times["no_recompute"]["step_s"],
                                     1 / times["recompute"]["step_s"], "steps/s",
                                     "without / with old-logprob recompute"))
        breakdown[dtype] = times
        log(f"rl-step/{dtype} done")
    report.details["rl_step_seconds"] = breakdown
    report.details["rl_step_setup"] = {"samples": s.rl_batch, "prompt_len": s.prompt_len, "sampling": "temperature 1",
                                       "new_tokens": s.rl_new_tokens, "epochs": 1, "minibatches": 1}


RUNNERS: dict[str, Callable[[Workbench, Report], None]] = {
    "vs-vllm": vs_vllm_suite, "vs-hf": vs_hf, "roofline": roofline_suite, "rl-step": rl_step}


def run_suites(which: str, model: str, setup: Setup, command: str) -> Report:
    """Run one suite (or ``all``) and return its report."""
    names = list(SUITES) if which == "all" else [which]
    report = Report(command=command, commands=[command])
    wb = Workbench(model, setup)
    wb.engines = {"reference"} | ({"hf"} if "vs-hf" in names else set())
    t0 = time.perf_counter()
    for name in names:
        RUNNERS[name](wb, report)
    report.seconds = time.perf_counter() - t0
    report.details["setup"] = {"model": model, **{k: v for k, v in setup.__dict__.items()},
                               "rollout": "greedy, EOS ignored, prefill included, median of repeats after a warm-up"}
    return report
