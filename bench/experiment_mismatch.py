"""The mismatch experiment: what a rollout that is not bitwise the trainer's does to training.

Arms, each one GRPO job through the real services (embedded local Ray, loopback), same model, data,
seeds and steps:

* ``consistent`` — our kernels in rollout and trainer, no recompute: logdiff 0, on-policy;
* ``fast`` — the rollout on the fast (non-invariant) kernels, no recompute: the rollout's logprobs
  are used as the old logprobs although the trainer's differ (the silent off-policy case);
* ``fast-tis`` — the same rollout, with the trainer's logprobs recomputed and the rollout–trainer
  importance weight truncated (``correction: {mode: tis}``).

Every step's event (reward, eval accuracy, K3 KL, max and mean |logdiff|, grad norm, clip fraction,
entropy, …) is written as JSON to ``RESULTS/mismatch-<date>-<arm>.json`` when the arm ends, and the
arms' curves are drawn into ``OUT/mismatch.png`` (``--replot DATE`` redraws them from the JSON
without running). Run by hand (not in CI)::

    .venv/bin/python -m onpolicy.bench.experiment_mismatch --steps 12 --out docs/experiments
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS: dict[str, dict[str, Any]] = {
    "consistent": {"rollout": {"kernels": "consistent"}},
    "fast": {"rollout": {"kernels": "fast"}},
    "fast-tis": {"rollout": {"kernels": "fast"}, "grpo": {"recompute_old_logprobs": True},
                 "correction": {"mode": "tis", "level": "token", "threshold": 2.0}},
}
#: One colour per arm in every panel (an arm missing from a log-scale panel, e.g. the consistent arm's
#: KL of exactly 0, does not shift the others' colours).
COLOURS = {"consistent": "tab:blue", "fast": "tab:orange", "fast-tis": "tab:green"}
CURVES = [("reward_mean", "reward"), ("eval_accuracy", "eval accuracy (greedy, held-out)"),
          ("kl_k3", "rollout-trainer K3 KL"), ("logdiff_mean", "mean |logdiff|"),
          ("logdiff_max", "max |logdiff|"), ("grad_norm", "grad norm"), ("clip_fraction", "clip fraction"),
          ("entropy", "entropy")]


def base_spec(model: str, steps: int, dtype: str, seed: int, lr: float) -> dict[str, Any]:
    """The demo job (``onpolicy.jobs.demo``: the task and sizes measured to learn) at ``dtype``, with
    enough training problems for ``steps`` and the eval split scored five times."""
    from onpolicy.jobs.demo import demo_spec

    spec = demo_spec(model, steps, lr=lr, seed=seed)
    return merge(spec, {"name": "mismatch", "kernels": {"dtype": dtype}, "checkpoint": {"keep_last": 1},
                        "dataset": {"size": max(64, steps * spec["grpo"]["prompts_per_step"])},
                        "eval": {"interval": max(1, steps // 5)}})


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def run_arm(arm: str, spec: dict[str, Any], state: Path) -> list[dict[str, Any]]:
    """One arm as a job on a fresh controller; its events as dicts."""
    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services import api
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.convert import event_dict, spec_to_proto
    from onpolicy.services.controller.servicer import jobs_server

    token = secrets.token_urlsafe(16)
    controller = JobController(state / arm, RayLauncher(token=token, state_dir=state / arm))
    server = jobs_server(controller, ServerConfig(port=0, token=token))
    try:
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=token))
        job = stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(parse_spec(spec))), timeout=120).job
        events = []
        for resp in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job.job_id)):
            ev = event_dict(resp.event)
            events.append(ev)
            if int(ev.get("weight_version") or 0):
                print(f"[{arm}] step {ev['step']}: reward {ev['reward_mean']:.3f} kl_k3 {ev['kl_k3']:.2e} "
                      f"mean|logdiff| {ev.get('logdiff_mean', 0):.2e}"
                      + (f" eval {ev['eval_accuracy']:.3f}" if "eval_accuracy" in ev else ""),
                      file=sys.stderr, flush=True)
        if events and events[-1]["state"] != "JOB_STATE_SUCCEEDED":
            raise RuntimeError(f"arm {arm}: {events[-1]['state']}: {events[-1].get('message', '')}")
        return events
    finally:
        controller.shutdown()
        server.stop()


def plot(results: dict[str, list[dict[str, Any]]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from onpolicy.jobs.plots import series

    fig, axes = plt.subplots(4, 2, figsize=(11, 11), squeeze=False)
    for ax, (field, label) in zip(axes.flat, CURVES, strict=True):
        log = field in ("kl_k3", "logdiff_mean", "logdiff_max")
        for arm, events in results.items():
            points = series(events).get(field, [])
            if log:
                points = [(s, v) for s, v in points if v > 0]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=arm,
                        color=COLOURS.get(arm))
        if log and ax.lines:
            ax.set_yscale("log")
        ax.set_title(label + (" (log; 0 not drawn)" if log else ""), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onpolicy.bench.experiment_mismatch", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--out", default="docs/experiments", help="where the plot goes")
    p.add_argument("--results", default="bench/results", help="where the raw JSON goes")
    p.add_argument("--replot", metavar="DATE", default="",
                   help="run nothing: redraw the plot from RESULTS/mismatch-DATE-<arm>.json (DATE as 2026-12-03)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; arms are {list(ARMS)}")
    out, results_dir = Path(args.out), Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = args.replot or time.strftime("%Y-%m-%d")
    if args.replot:
        arms = []
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    if arms:
        init_ray()
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="onpolicy-mismatch-") as tmp:
            for arm in arms:
                t0 = time.time()
                spec = merge(base_spec(args.model, args.steps, args.dtype, args.seed, args.lr), ARMS[arm])
                results[arm] = run_arm(arm, spec, Path(tmp))
                record = {"arm": arm, "spec": spec, "seconds": time.time() - t0, "events": results[arm]}
                path = results_dir / f"mismatch-{stamp}-{arm}.json"
                path.with_suffix(".tmp").write_text(json.dumps(record, indent=1))
                path.with_suffix(".tmp").replace(path)  # atomic: an interrupted run leaves no torn result
    finally:
        shutdown_ray()
    done = {a: json.loads((results_dir / f"mismatch-{stamp}-{a}.json").read_text())["events"] for a in ARMS
            if (results_dir / f"mismatch-{stamp}-{a}.json").is_file()}
    if not done:
        p.error(f"no results to plot: {results_dir}/mismatch-{stamp}-<arm>.json")
    png = plot(done, out / "mismatch.png", f"{args.model} {args.dtype}, GRPO on arithmetic, seed {args.seed}")
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
