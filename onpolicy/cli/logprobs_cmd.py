"""``onpolicy logprobs``: teacher-forced token logprobs on the training path."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from .common import add_model_args, emit_json, fail, kernel_config, load, read_json
from .generate_cmd import add_truncation_args, truncation_of

if TYPE_CHECKING:
    from onpolicy.kernels.truncation import Truncation
    from onpolicy.trainer.forward import ScoredSequence


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logprobs", help="score continuations on the training path (teacher forcing)")
    add_model_args(p)
    p.add_argument("--input", required=True, help='JSON list of {"prompt_ids": [...], "token_ids": [...]}')
    p.add_argument("--temperature", type=float, default=1.0)
    add_truncation_args(p, "of the distribution scored (an item's top_k/top_p/min_p override it)")
    p.add_argument("--pack-tokens", type=int, default=4096, help="rows per packed batch (default 4096)")
    p.add_argument("--json", action="store_true", help="print JSON (floats round-trip exactly)")
    p.set_defaults(func=run)


def parse_sequences(data: Any, temperature: float, source: str, truncation: Truncation | None = None,
                    ) -> list[ScoredSequence]:
    """A list of {prompt_ids, token_ids[, temperature, top_k, top_p, min_p]} items, or generate's output
    object; missing keys take ``temperature`` / ``truncation``."""
    from onpolicy.kernels.truncation import NONE
    from onpolicy.trainer.forward import ScoredSequence

    default = (truncation or NONE).to_dict()
    if isinstance(data, dict) and "completions" in data:
        data = data["completions"]
    if not isinstance(data, list) or not data:
        fail(f"{source}: expected a non-empty JSON list of {{prompt_ids, token_ids}} objects")
    seqs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            fail(f"{source}: item {i} is not an object")
        ids = {}
        for key in ("prompt_ids", "token_ids"):
            v = item.get(key)
            if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                fail(f"{source}: item {i}: {key} must be a non-empty list of integers")
            ids[key] = tuple(v)
        t = item.get("temperature", temperature)
        if not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            fail(f"{source}: item {i}: temperature must be a finite number > 0")
        trunc = {k: item.get(k, v) for k, v in default.items()}
        try:
            seqs.append(ScoredSequence(ids["prompt_ids"], ids["token_ids"], float(t), **trunc))
        except (TypeError, ValueError) as e:
            fail(f"{source}: item {i}: {e}")
    return seqs


def run(args: argparse.Namespace) -> int:
    import torch

    from onpolicy.trainer.forward import sequence_logprobs

    if not math.isfinite(args.temperature) or args.temperature <= 0:
        fail("--temperature must be a finite number > 0")
    if args.pack_tokens < 1:
        fail("--pack-tokens must be >= 1")
    truncation = truncation_of(args)
    seqs = parse_sequences(read_json(args.input), args.temperature, args.input, truncation)
    config = kernel_config(args)
    lm = load(args, config)
    try:
        with torch.no_grad():
            out = sequence_logprobs(lm.model, seqs, pack_tokens=args.pack_tokens)
    except ValueError as e:
        fail(str(e))
    results = [{"logprobs": lp.tolist()} for lp in out]
    if args.json:
        emit_json({"model": lm.name, "kernel_fingerprint": config.fingerprint,
                   "weight_sha256": lm.weights_sha256, "results": results})
    else:
        for i, (s, lp) in enumerate(zip(seqs, out, strict=True)):
            print(f"[{i}] {len(s.token_ids)} tokens  sum logprob {lp.sum().item():.6f}  "
                  f"mean {lp.mean().item():.6f}")
    return 0
