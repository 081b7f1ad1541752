"""``onpolicy diagnose``: replay one sequence through the rollout and training paths with
per-operator capture and name the first divergent operator and its class (docs/diagnosis.md).

Exit code 0: no divergence; 1: a divergence was diagnosed; 2: bad input (one line on stderr)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import emit_json, fail, read_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="find the first operator where rollout and trainer logprobs diverge, and why")
    p.add_argument("sample", nargs="?", help="mismatch-store sample JSON, or `onpolicy generate --json` output")
    p.add_argument("--model", help="model reference (default: the sample's model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (chat template applied)")
    src.add_argument("--prompt-ids", help="prompt token ids: 1,2,3 or a JSON list")
    p.add_argument("--token-ids", help="continuation token ids (default: sampled by the rollout path)")
    p.add_argument("--index", type=int, default=0, help="which completion of a generate --json file (default 0)")
    p.add_argument("--rollout", default="", metavar="OPTS",
                   help="rollout path key=value,...: kernels, dtype, temperature, top_k, top_p, min_p, kv_tile, "
                        "weights")
    p.add_argument("--trainer", default="", metavar="OPTS", help="training path key=value,... (same keys)")
    p.add_argument("--temperature", type=float, default=None,
                   help="both paths' temperature (default: the sample's, else 1; 0 = greedy sampling)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="continuation length when sampling (default 16)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when sampling the continuation")
    p.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object")
    p.set_defaults(func=run)


def parse_ids(text: str, flag: str) -> list[int]:
    text = text.strip()
    try:
        ids: Any = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        fail(f"{flag}: expected integers like 1,2,3 or a JSON list")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        fail(f"{flag}: expected a non-empty list of integers")
    return ids


def run(args: argparse.Namespace) -> int:
    from onpolicy.models.loading import ModelLoadError
    from onpolicy.verification.doctor import diagnose, diagnose_sample
    from onpolicy.verification.doctor_paths import PathOptions

    if args.max_new_tokens < 1:
        fail("--max-new-tokens must be >= 1")
    opts = {}
    for flag in ("rollout", "trainer"):
        try:
            opts[flag] = PathOptions.parse(getattr(args, flag))
        except ValueError as e:
            fail(f"--{flag}: {e}")
    rollout, trainer = opts["rollout"], opts["trainer"]
    try:
        if args.sample is not None:
            if args.prompt is not None or args.prompt_ids is not None or args.token_ids is not None:
                fail("give either a SAMPLE file or --prompt/--prompt-ids, not both")
            if args.temperature is not None:
                fail("--temperature: a sample carries its temperature (override a path with --rollout/--trainer)")
            diag = diagnose_sample(read_json(args.sample), model=args.model, index=args.index, rollout=rollout,
                                   trainer=trainer, source=args.sample)
        else:
            if not args.model:
                fail("give a SAMPLE file, or --model with --prompt or --prompt-ids")
            if args.prompt is None and args.prompt_ids is None:
                fail("give --prompt or --prompt-ids (or a SAMPLE file)")
            prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
            token_ids = parse_ids(args.token_ids, "--token-ids") if args.token_ids is not None else None
            diag = diagnose(args.model, prompt=args.prompt, prompt_ids=prompt_ids, token_ids=token_ids,
                            rollout=rollout, trainer=trainer, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    except (ModelLoadError, FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.json:
        emit_json(diag.to_dict())
    else:
        print(diag.format())
    return 1 if diag.divergent else 0
