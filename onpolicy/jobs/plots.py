"""Per-step curves of a job, drawn from its events (``JobEvent`` dicts as ``events.jsonl`` holds them
and ``WatchJob`` streams them): reward, eval accuracy, loss, gradient norm and clip fraction,
entropy, the rollout-trainer KL and max |logdiff|, throughput. One PNG, written atomically."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: (panel title, [(series label, event field)], log scale)
PANELS: list[tuple[str, list[tuple[str, str]], bool]] = [
    ("reward", [("reward mean", "reward_mean")], False),
    ("eval accuracy (greedy, held-out)", [("eval accuracy", "eval_accuracy")], False),
    ("policy loss", [("loss", "loss")], False),
    ("grad norm / clip fraction", [("grad norm", "grad_norm"), ("clip fraction", "clip_fraction")], False),
    ("entropy", [("entropy", "entropy")], False),
    ("rollout vs trainer", [("KL k3", "kl_k3"), ("max |logdiff|", "logdiff_max"),
                            ("mean |logdiff|", "logdiff_mean")], True),
    ("throughput (tokens/s)", [("rollout", "rollout_tokens_per_s"), ("trainer", "trainer_tokens_per_s")], False),
    ("tokens verified / mismatched", [("checked", "tokens_checked"), ("mismatched", "tokens_mismatched")], False),
]


def series(events: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Field -> [(step, value)] over the step events (and the eval events, for ``eval_accuracy``);
    a resumed job's redone steps keep their last value."""
    out: dict[str, dict[int, float]] = {}
    for ev in events:
        step = int(ev.get("step", 0))
        is_step = int(ev.get("weight_version") or 0) > 0  # WatchJob's JSON spells int64 as a string
        for _, fields, _ in PANELS:
            for _, name in fields:
                value = ev.get(name)
                if value is None or (name != "eval_accuracy" and not is_step):
                    continue
                out.setdefault(name, {})[step] = float(value)
    return {name: sorted(points.items()) for name, points in out.items()}


def plot_events(events: Iterable[Mapping[str, Any]], out: Path, title: str) -> Path:
    """Draw the job's curves into the PNG ``out`` (a temporary file renamed into place)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(events)
    if not any(data.values()):
        raise ValueError("the job has no step events yet")
    cols = 2
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows), squeeze=False)
    for ax, (panel, fields, log) in zip(axes.flat, PANELS, strict=False):
        drawn = False
        for label, name in fields:
            points = data.get(name, [])
            if log:
                points = [(s, v) for s, v in points if v > 0]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
                drawn = True
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if log and drawn:
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "0 at every step" if log else "not measured", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="gray")
        elif len(fields) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
