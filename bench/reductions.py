"""``onpolicy bench reductions``: the cost of the canonical row-parallel reduction.

Two measurements, both as calls per second of one row-parallel linear (``o_proj`` and
``down_proj`` shapes of the model, default SmolLM2-135M: 576x576 and 1536->576, fp32):

- **TP=1, one process**: ``Backend.row_linear`` of the consistent backend (``reduce_chunks``
  chunk GEMMs, fp32 fold in chunk order) against one plain row-tiled GEMM (what the reference
  backend computed before the canonical reduction) and against the fast backend's ``F.linear``.
- **TP=2, two local processes (gloo over loopback)**: canonical (chunk partials all-gathered, folded
  on every rank) against the fast backend's plain all-reduce of one local GEMM.

``--whole-model ROUNDS`` adds the model-level cost: a training-path forward and a short rollout with
the canonical reduction vs the same model whose row-parallel linears are one plain row-tiled GEMM.

Rows: 8 (a decode step, the row tile), 64 and 512 (prefill / training packs). The variants are
timed interleaved, call by call, and the median is reported, so a shared machine's changing load
hits them alike; the ratios are the point.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

ROWS = (8, 64, 512)


def add_parser(benches: argparse._SubParsersAction) -> None:
    text = "canonical row-parallel reduction vs plain GEMM (TP=1) and vs plain all-reduce (TP=2, gloo)"
    b = benches.add_parser("reductions", help=text, description=text)
    b.add_argument("--model", default="smollm2", help="model whose shapes are used (default smollm2)")
    b.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts (default 8,64,512)")
    b.add_argument("--repeats", type=int, default=50, help="timed calls per measurement, median (default 50)")
    b.add_argument("--no-tp2", action="store_true", help="skip the two-process TP=2 measurement")
    b.add_argument("--whole-model", type=int, default=0, metavar="ROUNDS",
                   help="also time the whole model (training forward 2x256 tokens, rollout 8x16 tokens), canonical vs "
                        "plain row-tiled GEMM for the row-parallel linears, ROUNDS interleaved rounds (default 0: off)")
    b.add_argument("--threads", type=int, default=0, help="torch threads in this process (default 0: torch's choice)")
    b.add_argument("--json", action="store_true", help="JSON for machines instead of the table")
    b.set_defaults(func=run)


def _shapes(model: str) -> dict[str, tuple[int, int]]:
    """``name -> (K, Out)`` of the row-parallel linears of ``model``."""
    from onpolicy.models.config import ModelConfig

    if model == "smollm2":
        return {"o_proj": (576, 576), "down_proj": (1536, 576)}
    from onpolicy.models.tiny import SPECS

    if model not in SPECS:
        raise ValueError(f"unknown model {model!r}: smollm2 or one of {sorted(SPECS)}")
    family, kw = SPECS[model]
    cfg = ModelConfig.from_hf({**kw, "model_type": family})
    return {"o_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}


class _Weight:
    def __init__(self, w: Any) -> None:
        self.weight = w
        self._chunks: dict[int, Any] = {}

    def chunked(self, chunks: int) -> Any:
        from onpolicy.kernels.backend import chunk_major

        if chunks not in self._chunks:
            self._chunks[chunks] = chunk_major(self.weight, chunks)
        return self._chunks[chunks]


def _times(fns: list[Any], repeats: int) -> list[float]:
    """Median seconds per call of each function, the calls interleaved round by round so that a
    change of load on a shared machine hits every function alike."""
    import statistics

    for fn in fns:
        fn()
    rounds: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, rounds, strict=True):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in rounds]


def _tp1(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int) -> list[tuple[str, float, float, str]]:
    import torch

    from onpolicy.kernels import KernelConfig, get_backend

    ref, fast = get_backend(KernelConfig()), get_backend(KernelConfig(backend="fast"))
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, (k, o) in shapes.items():
        w = _Weight(torch.randn(o, k, generator=gen) * 0.05)
        for n in rows:
            x = torch.randn(n, k, generator=gen)
            canon, plain, flin = _times([lambda x=x, w=w: ref.row_linear(x, w),
                                         lambda x=x, w=w: ref.linear(x, w.weight),
                                         lambda x=x, w=w: fast.row_linear(x, w)], repeats)
            out.append((f"tp1 {name} [{n}x{k}]->{o} canonical vs one rowdot linear", 1 / canon, 1 / plain, "calls/s"))
            out.append((f"tp1 {name} [{n}x{k}]->{o} canonical vs fast F.linear", 1 / canon, 1 / flin, "calls/s"))
    return out


def _tp2_worker(rank: int, world: int, shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int,
                ) -> list[tuple[str, float, float, str]]:
    import torch

    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.parallel.groups import GlooShardGroup

    ref, fast = get_backend(KernelConfig()), get_backend(KernelConfig(backend="fast"))
    group = GlooShardGroup(world, rank)
    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for name, (k, o) in shapes.items():
            w = torch.randn(o, k, generator=gen) * 0.05
            shard = _Weight(w[:, rank * k // world:(rank + 1) * k // world].contiguous())
            for n in rows:
                x = torch.randn(n, k // world, generator=gen)
                canon, plain = _times([lambda x=x, s=shard: ref.row_linear(x, s, group),
                                       lambda x=x, s=shard: fast.row_linear(x, s, group)], repeats)
                out.append((f"tp2 {name} [{n}x{k}]->{o} canonical gather+fold vs plain all-reduce", 1 / canon,
                            1 / plain, "calls/s"))
    return out


def _whole_model(model: str, rounds: int) -> list[tuple[str, float, float, str]]:
    """The model with the canonical reduction vs the same model whose row-parallel linears are one
    plain rowdot linear over all of K (TP=1; not invariant across degrees), swapped round by round."""
    import statistics

    import torch

    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.kernels.backend import SINGLE, RowWeight, ShardGroup
    from onpolicy.kernels.reference import ReferenceBackend
    from onpolicy.models.registry import load_model
    from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
    from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

    class PlainRows(ReferenceBackend):
        def row_linear(self, x: torch.Tensor, weight: RowWeight, group: ShardGroup = SINGLE) -> torch.Tensor:
            return self.linear(x, weight.weight)

    lm = load_model(model, get_backend(KernelConfig()))
    variants = {"canonical": lm.model.ops, "plain": PlainRows(lm.model.ops.config)}
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    seqs = [ScoredSequence(tuple(ids(128)), tuple(ids(128))) for _ in range(2)]
    prompts = [ids(32) for _ in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1, ignore_eos=True)

    def train() -> None:
        with torch.no_grad():
            sequence_logprobs(lm.model, seqs)

    def roll() -> None:
        RolloutEngine(lm, EngineConfig(kv_cache_tokens=4096)).generate(prompts, params)

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, ops in variants.items():
            lm.model.ops = ops
            for what, fn in (("training forward 2x256 tokens", train), ("rollout 8 prompts x 16 tokens", roll)):
                t0 = time.perf_counter()
                fn()
                times.setdefault((what, name), []).append(time.perf_counter() - t0)
    lm.model.ops = variants["canonical"]
    return [(f"whole {model} {what} canonical vs plain row GEMM", 1 / statistics.median(times[(what, "canonical")]),
             1 / statistics.median(times[(what, "plain")]), "runs/s")
            for what in ("training forward 2x256 tokens", "rollout 8 prompts x 16 tokens")]


def run(args: argparse.Namespace) -> int:
    from onpolicy.bench.common import Report, Result
    from onpolicy.cli.common import emit_json, fail

    try:
        rows = [int(r) for r in args.rows.split(",") if r]
        shapes = _shapes(args.model)
    except ValueError as e:
        fail(f"--rows must be comma-separated integers ({e})" if "invalid literal" in str(e) else str(e))
    if not rows or min(rows) < 1 or args.repeats < 1:
        fail("--rows and --repeats must be >= 1")
    if args.threads < 0:
        fail("--threads must be >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    report = Report(f"onpolicy bench reductions --model {args.model} --rows {args.rows} --repeats {args.repeats}"
                    f"{' --whole-model ' + str(args.whole_model) if args.whole_model else ''}"
                    f"{' --threads ' + str(args.threads) if args.threads else ''}")
    measured = _tp1(shapes, rows, args.repeats)
    if not args.no_tp2:
        from onpolicy.parallel.launch import run_workers

        measured += run_workers(_tp2_worker, 2, shapes, rows, args.repeats, timeout_s=600)[0]
    if args.whole_model > 0:
        measured += _whole_model(args.model, args.whole_model)
    report.results = [Result(name, ours, base, unit, "ratio < 1: canonical is slower")
                      for name, ours, base, unit in measured]
    report.seconds = time.perf_counter() - t0
    if args.json:
        emit_json(report.to_dict())
    else:
        report.print_table()
    return 0
