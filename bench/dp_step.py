"""Step time of the data-parallel trainer at D = 1, 2 (a benchmark, run by hand).

    .venv/bin/python -m onpolicy.bench.dp_step --model tiny-qwen3 --samples 16 --steps 3
    .venv/bin/python -m onpolicy.bench.dp_step --model smollm2 --samples 8 --steps 2

Synthetic prompts of ``--prompt-len`` random tokens with ``--completion-len`` continuation tokens,
old logprobs from rank 0's training forward (so the step is bitwise on-policy), one minibatch,
``--pack-tokens`` rows per canonical unit, every rank on ``--threads`` torch threads. Prints one JSON
line per degree: median step seconds after one warm-up step, units per minibatch, and whether the
weights after the run equal the D = 1 run's (sha256).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.selftest import num_threads
from onpolicy.models.registry import load_model
from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray
from onpolicy.services.cluster.peers import ray_peers
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainerConfig, TrainSample
from onpolicy.trainer.data_parallel import DataParallelEngine
from onpolicy.trainer.forward import ScoredSequence, pack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--completion-len", type=int, default=40)
    ap.add_argument("--pack-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--degrees", default="1,2")
    args = ap.parse_args()
    init_ray(num_cpus=8)
    kernels = KernelConfig(kv_tile=64)
    config = TrainerConfig(pack_tokens=args.pack_tokens)
    results = {}
    try:
        for degree in (int(d) for d in args.degrees.split(",")):
            with num_threads(args.threads):
                lm = load_model(args.model, get_backend(kernels))
                rng = random.Random(0)  # the same batch at every degree
                vocab = lm.config.vocab_size
                seqs = [ScoredSequence(tuple(rng.randrange(vocab) for _ in range(args.prompt_len)),
                                       tuple(rng.randrange(vocab) for _ in range(args.completion_len)))
                        for _ in range(args.samples)]
                with DataParallelEngine(lm, config, degree=degree, launch=ray_peers, model_ref=args.model,
                                        threads_per_worker=args.threads) as eng:
                    old = eng.compute_logprobs(seqs)
                    samples = [TrainSample(prompt_ids=s.prompt_ids, token_ids=s.token_ids,
                                           old_logprobs=tuple(o.tolist()), advantage=rng.gauss(0, 1))
                               for s, o in zip(seqs, old, strict=True)]
                    times = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        eng.train_step(samples, LossConfig(), OptimizerConfig(lr=1e-5))
                        times.append(time.perf_counter() - t0)
                    results[degree] = eng.weights_sha256
                    print(json.dumps({
                        "model": args.model, "degree": degree, "threads_per_rank": args.threads,
                        "samples": args.samples, "units": len(pack(seqs, args.pack_tokens)),
                        "step_seconds_median": round(statistics.median(times[1:] or times), 3),
                        "step_seconds": [round(t, 3) for t in times],
                        "weights_equal_to_first_degree": results[degree] == next(iter(results.values()))}),
                        flush=True)
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
