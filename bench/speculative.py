"""``onpolicy bench speculative``: our rollout with n-gram speculative decoding vs without it.

For each workload and batch size, the plain engine and the speculative one (``rollout.speculative:
ngram``, ``--num-speculative-tokens`` drafts) generate the same greedy completions (EOS ignored,
exactly ``--new-tokens`` per prompt, prefill included), taking turns for ``--rounds`` rounds after a
warm-up; the medians are reported as ``speculative/{workload}/bs{B}/{dtype}``, ratio = speculative /
plain. Workloads:

* ``arithmetic``: ``--prompt-len`` tokens of ``a + (a+1) = (2a+1)`` lines, which the model goes on
  writing (repetitive structure, but each line's numbers are new);
* ``copy``: the chat-templated instruction to repeat a short Python function (about 90 tokens), which
  the model copies;
* ``random``: ``--prompt-len`` random token ids (what the model writes after them is not a copy).

Models without a tokenizer get ``--prompt-len`` tokens of a random 8-token unit repeated for both
repetitive workloads.
``details`` has, per row, the acceptance rate (accepted / drafted tokens), the tokens emitted per
engine step, and whether the speculative completions equal the plain ones bit for bit (tokens and
logprobs; they always must).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the parser is built without torch (``onpolicy --help``)
    from .common import Report

WORKLOADS = ("arithmetic", "copy", "random")
COPY_INSTRUCTION = "Repeat this Python code exactly, nothing else:"
_NAMES = ["count", "total", "value", "index", "limit", "offset", "scale", "result"]


def code_snippet(rng: random.Random) -> str:
    """A short Python function with random names and constants (the ``copy`` workload's text)."""
    a, b, c, d = rng.sample(_NAMES, 4)
    return (f"def update_{a}({b}, {c}):\n    {d} = {b} * {rng.randint(2, 9)} + {c}\n"
            f"    if {d} > {rng.randint(10, 99)}:\n        {d} = {d} - {c}\n"
            f"    for {a} in range({rng.randint(3, 20)}):\n        {d} += {a} * {b}\n    return {d}\n")


def workload_prompts(lm: Any, workload: str, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``workload``, each one different (``prompt_len`` tokens but for ``copy``)."""
    from .rollout import prompts_for

    vocab = lm.config.vocab_size
    if workload == "random":
        return prompts_for(batch, prompt_len, vocab, seed)
    out = []
    for i in range(batch):
        rng = random.Random(seed * 1000 + i)
        if lm.tokenizer is None:
            unit = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(8)]
            out.append((unit * (prompt_len // len(unit) + 1))[:prompt_len])
        elif workload == "arithmetic":
            start = rng.randint(1, 50)
            text = "".join(f"{a} + {a + 1} = {2 * a + 1}\n" for a in range(start, start + prompt_len))
            out.append(lm.tokenizer.encode(text)[:prompt_len])
        else:
            out.append(lm.tokenizer.encode(lm.tokenizer.chat_prompt(f"{COPY_INSTRUCTION}\n\n{code_snippet(rng)}")))
    return out


def _engine(lm: Any, batch: int, tokens_per_seq: int, spec: Any) -> Any:
    from onpolicy.rollout import EngineConfig, RolloutEngine

    page = lm.model.ops.config.kv_tile
    kv = batch * (-(-(tokens_per_seq + 64) // page) + 1) * page
    return RolloutEngine(lm, EngineConfig(max_num_seqs=batch, max_batched_tokens=max(2048, batch * tokens_per_seq),
                                          kv_cache_tokens=kv, prefix_cache=False, speculative=spec))


def measure(lm: Any, prompts: list[list[int]], new_tokens: int, k: int, rounds: int) -> dict[str, Any]:
    """Both engines on ``prompts`` in alternating rounds: tok/s medians, acceptance, bitwise equality."""
    import torch

    from onpolicy.rollout import SamplingParams
    from onpolicy.rollout.speculative import NGRAM, SpeculativeConfig

    from .common import alternating

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    engines = {"plain": _engine(lm, len(prompts), len(prompts[0]) + new_tokens, SpeculativeConfig()),
               "speculative": _engine(lm, len(prompts), len(prompts[0]) + new_tokens,
                                      SpeculativeConfig(method=NGRAM, num_tokens=k))}
    outputs: dict[str, Any] = {}
    for engine in engines.values():
        engine.generate(prompts, warm)

    def run(name: str) -> float:
        engine = engines[name]
        before = engine.stats()
        t0 = time.perf_counter()
        outputs[name] = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        after = engine.stats()
        outputs[name + "_stats"] = (after.spec_drafted - before.spec_drafted,
                                    after.spec_accepted - before.spec_accepted, after.steps - before.steps)
        return len(prompts) * new_tokens / seconds

    runs = alternating({name: lambda name=name: run(name) for name in engines}, rounds)
    drafted, accepted, steps = outputs["speculative_stats"]
    same = all(a.token_ids == b.token_ids and torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
               for a, b in zip(outputs["plain"], outputs["speculative"], strict=True))
    return {"plain_tok_s": statistics.median(runs["plain"]),
            "speculative_tok_s": statistics.median(runs["speculative"]),
            "rounds_tok_s": runs, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": len(prompts) * new_tokens / steps / len(prompts), "bitwise_equal": same}


def run_speculative(model: str, dtype: str, batches: tuple[int, ...], workloads: tuple[str, ...], prompt_len: int,
                    new_tokens: int, k: int, rounds: int, command: str) -> Report:
    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.models.registry import load_model

    from .common import Report, Result, log

    t0 = time.perf_counter()
    lm = load_model(model, get_backend(KernelConfig(compute_dtype=dtype)))  # type: ignore[arg-type]
    report = Report(command)
    rows: dict[str, Any] = {}
    for workload in workloads:
        for bs in batches:
            name = f"speculative/{workload}/bs{bs}/{dtype}"
            log(f"{name} ...")
            m = measure(lm, workload_prompts(lm, workload, bs, prompt_len), new_tokens, k, rounds)
            rows[name] = m
            report.results.append(Result(name, m["speculative_tok_s"], m["plain_tok_s"], "tok/s",
                                         f"acceptance {m['acceptance']:.2f}, {m['tokens_per_step']:.2f} tokens/step"
                                         f"{'' if m['bitwise_equal'] else ', NOT BITWISE EQUAL'}"))
    report.details["speculative"] = rows
    report.details["setup"] = {"model": model, "dtype": dtype, "batches": list(batches), "workloads": list(workloads),
                               "prompt_len": prompt_len, "new_tokens": new_tokens, "num_speculative_tokens": k,
                               "rounds": rounds, "rollout": "greedy, EOS ignored, prefill included, median of "
                               "alternating rounds after a warm-up; ratio = speculative / plain"}
    report.seconds = time.perf_counter() - t0
    return report


def add_parser(benches: argparse._SubParsersAction) -> None:
    text = "rollout tok/s with n-gram speculative decoding vs without, on repetitive and random prompts"
    b = benches.add_parser("speculative", help=text, description=text)
    b.add_argument("--model", default="smollm2", help="smollm2 (default) | tiny-llama | ... | PATH")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    b.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    b.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    b.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    b.add_argument("--new-tokens", type=int, default=64, help="generated tokens per sequence (default 64)")
    b.add_argument("--num-speculative-tokens", type=int, default=4, help="drafted tokens per step (default 4)")
    b.add_argument("--rounds", type=int, default=1, help="alternating timed rounds, medians reported (default 1)")
    b.add_argument("--json", action="store_true", help="JSON for machines instead of the table")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from onpolicy.cli.common import emit_json, fail
    from onpolicy.models.loading import ModelLoadError

    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b)
    except ValueError:
        fail("--batches must be comma-separated integers")
    if not batches or min(batches) < 1:
        fail("--batches must be comma-separated integers >= 1")
    workloads = tuple(w for w in args.workloads.split(",") if w)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        fail(f"--workloads: {bad[0] if bad else 'none given'} is not one of {', '.join(WORKLOADS)}")
    for opt in ("prompt_len", "new_tokens", "num_speculative_tokens", "rounds"):
        if getattr(args, opt) < 1:
            fail(f"--{opt.replace('_', '-')} must be >= 1")
    if args.num_speculative_tokens > 64:
        fail("--num-speculative-tokens must be <= 64")
    command = "onpolicy " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "onpolicy bench speculative"
    try:
        report = run_speculative(args.model, args.dtype, batches, workloads, args.prompt_len, args.new_tokens,
                                 args.num_speculative_tokens, args.rounds, command)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        fail(str(e).splitlines()[0])
    if args.json:
        emit_json(report.to_dict())
    else:
        report.print_table()
    return 0
