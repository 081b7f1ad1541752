"""``onpolicy generate``: sample completions with the rollout engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from onpolicy.rollout.names import ENGINES, OWN_ENGINE

from .common import add_model_args, emit_json, fail, kernel_config, load

if TYPE_CHECKING:
    from onpolicy.kernels.truncation import Truncation
    from onpolicy.models.loading import LoadedModel
    from onpolicy.rollout import EngineConfig
    from onpolicy.rollout.interface import Engine, EngineSnapshot


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=list(ENGINES), default=OWN_ENGINE,
                   help="rollout engine: onpolicy (default) or vllm (vLLM with our operators; --kernels fast: "
                        "vLLM's own kernels; needs scripts/setup.sh --vllm)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests in the running batch (default 32)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token rows per step (default 2048)")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on")
    p.add_argument("--speculative", choices=["none", "ngram"], default="none",
                   help="ngram: speculative decoding with prompt-lookup drafts (engine onpolicy; the same tokens "
                        "and logprob bits as none)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="most drafted tokens per request and decode step (default 4)")


def add_truncation_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--top-p`` / ``--top-k`` / ``--min-p`` (``onpolicy.kernels.truncation``)."""
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus truncation {what} (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help=f"keep the k most likely tokens {what} (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help=f"keep tokens >= min_p x the most likely one's probability {what} (default 0 = off)")


def truncation_of(args: argparse.Namespace) -> Truncation:
    """The command line's truncation (exits naming the bad value)."""
    from onpolicy.kernels.truncation import Truncation

    try:
        return Truncation(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    except ValueError as e:
        fail(f"--{str(e).split()[0].replace('_', '-')}: {e}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions with token logprobs (rollout engine)")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt")
    src.add_argument("--prompts", help='JSONL file of {"prompt": "..."} or {"prompt_ids": [...]} lines')
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    add_truncation_args(p, "when sampling; logprobs are the renormalised ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template to text prompts")
    add_engine_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace, need_tokens: int | None = None) -> EngineConfig:
    """Engine options from the command line; the KV cache is sized to what the requests can use
    (at most the engine default), so a small job does not allocate the whole budget."""
    from onpolicy.rollout import EngineConfig
    from onpolicy.rollout.speculative import NONE, SpeculativeConfig

    speculative = getattr(args, "speculative", NONE)
    if speculative != NONE and args.engine != OWN_ENGINE:
        fail(f"--speculative {speculative}: needs --engine {OWN_ENGINE} (engine {args.engine} has no invariant "
             "speculative decoding)")
    try:
        spec = SpeculativeConfig(method=speculative, num_tokens=getattr(args, "num_speculative_tokens", 4))
    except ValueError as e:
        fail(f"--{str(e).split()[0].replace('_', '-')}: {e}")
    try:
        cap = EngineConfig().kv_cache_tokens
        tokens = cap if need_tokens is None else max(64, min(cap, need_tokens))
        return EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                            prefix_cache=args.prefix_cache == "on", kv_cache_tokens=tokens, speculative=spec)
    except ValueError as e:
        fail(str(e))


def check_engine_available(args: argparse.Namespace) -> None:
    """Exit 2 naming what is missing when ``--engine`` cannot run here (before any model is loaded)."""
    from onpolicy.rollout.engines import EngineUnavailable, check_engine

    try:
        check_engine(args.engine)
    except EngineUnavailable as e:
        fail(str(e))


def build_engine(args: argparse.Namespace, lm: LoadedModel, config: EngineConfig) -> Engine:
    """The ``--engine`` on ``lm`` (the vLLM engine reads the model itself and keeps ``lm`` as its mirror)."""
    from onpolicy.rollout import RolloutEngine

    if args.engine == OWN_ENGINE:
        return RolloutEngine(lm, config)
    from onpolicy.rollout.vllm.engine import VllmEngine

    try:
        return VllmEngine(args.model, lm.model.ops.config, config, lm=lm)
    except ValueError as e:
        fail(str(e).splitlines()[0])


def read_prompts(args: argparse.Namespace, lm: LoadedModel) -> list[list[int]]:
    items: list[dict] = []
    if args.prompt is not None:
        items.append({"prompt": args.prompt})
    else:
        path = Path(args.prompts)
        if not path.is_file():
            fail(f"{args.prompts}: no such file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{args.prompts}:{n}: not valid JSON ({e.msg})")
            if not isinstance(obj, dict) or not ({"prompt", "prompt_ids"} & set(obj)):
                fail(f'{args.prompts}:{n}: expected {{"prompt": "..."}} or {{"prompt_ids": [...]}}')
            items.append(obj)
        if not items:
            fail(f"{args.prompts}: no prompts")
    prompts = []
    for n, obj in enumerate(items):
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                fail(f"prompt {n}: prompt_ids must be a non-empty list of integers")
            prompts.append(ids)
        else:
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                fail(f"prompt {n}: prompt must be a non-empty string")
            if lm.tokenizer is None:
                fail(f"model {lm.name} has no tokenizer: give prompt_ids instead of text")
            prompts.append(lm.tokenizer.encode(text if args.raw else lm.tokenizer.chat_prompt(text)))
    return prompts


def run(args: argparse.Namespace) -> int:
    from onpolicy.rollout import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.n,
                                seed=args.seed, **truncation_of(args).to_dict())
    except ValueError as e:
        fail(str(e))
    engine_config(args)  # validate engine options before loading the model
    check_engine_available(args)
    config = kernel_config(args)
    lm = load(args, config)
    prompts = read_prompts(args, lm)
    page = config.kv_tile
    need = sum(-(-(len(p) + args.max_new_tokens) // page) * page for p in prompts) * args.n
    engine = build_engine(args, lm, engine_config(args, need))
    last = [0.0]

    def progress(stats: EngineSnapshot, done: int, total: int) -> None:
        if stats.seconds - last[0] >= 1.0 or done == total:
            last[0] = stats.seconds
            rate = stats.tokens_generated / stats.seconds if stats.seconds else 0.0
            spec = (f", {stats.spec_accepted}/{stats.spec_drafted} drafted tokens accepted"
                    if stats.spec_drafted else "")
            print(f"\r{done}/{total} completions, {stats.tokens_generated} tokens, {rate:.1f} tokens/s{spec}",
                  end="\n" if done == total else "", file=sys.stderr, flush=True)

    try:
        comps = engine.generate(prompts, params, progress=None if args.json else progress)
    except ValueError as e:
        fail(str(e))
    decode = lm.tokenizer.decode if lm.tokenizer is not None else None
    if args.json:
        stats = engine.stats()
        emit_json({"model": lm.name, "kernel_fingerprint": config.fingerprint, "weight_sha256": lm.weights_sha256,
                   **({"speculative": {"method": args.speculative, "drafted": stats.spec_drafted,
                                       "accepted": stats.spec_accepted}} if args.speculative != "none" else {}),
                   "completions": [{"prompt_index": c.prompt_index, "sample_index": c.sample_index,
                                    "prompt_ids": list(c.prompt_ids), "token_ids": list(c.token_ids),
                                    "logprobs": list(c.logprobs), "temperature": c.temperature,
                                    **c.truncation.to_dict(),
                                    "text": decode(list(c.token_ids)) if decode else None,
                                    "finish_reason": c.finish_reason} for c in comps]})
    else:
        for c in comps:
            text = decode(list(c.token_ids)) if decode else " ".join(map(str, c.token_ids))
            print(f"--- prompt {c.prompt_index} sample {c.sample_index} ({len(c.token_ids)} tokens, "
                  f"{c.finish_reason}, sum logprob {sum(c.logprobs):.3f})\n{text}")
    return 0
