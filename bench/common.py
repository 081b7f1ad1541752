"""What every benchmark shares: timing (median over repeats), machine info and versions, result rows,
the report (a table for people, JSON for machines)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import torch


@dataclass
class Result:
    """One measured pair: ``ratio = ours / baseline`` (both throughputs, higher is better)."""

    name: str
    ours: float
    baseline: float
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("nan")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "ours": self.ours, "baseline": self.baseline, "ratio": self.ratio,
                "unit": self.unit, "note": self.note}


@dataclass
class Report:
    command: str
    results: list[Result] = field(default_factory=list)
    details: dict[str, object] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "commands": self.commands or [self.command], "machine": machine(),
                "versions": versions(), "seconds": round(self.seconds, 1),
                "results": [r.to_dict() for r in self.results], "details": self.details}

    def print_table(self) -> None:
        w = max([len(r.name) for r in self.results] + [10])
        print(f"{'benchmark':<{w}}  {'ours':>12}  {'baseline':>12}  {'ratio':>7}  unit")
        for r in self.results:
            print(f"{r.name:<{w}}  {r.ours:>12.2f}  {r.baseline:>12.2f}  {r.ratio:>7.3f}  {r.unit}"
                  f"{'  (' + r.note + ')' if r.note else ''}")
        for k, v in self.details.items():
            print(f"{k}: {json.dumps(v)}")
        print(f"({self.seconds:.0f} s)")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, object]:
    return {"platform": platform.platform(), "cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads()}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("onpolicy", "torch", "transformers", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def median_time(fn: Callable[[], object], repeats: int, warm: Callable[[], object] | None = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one warm-up call (``warm``, or ``fn``)."""
    (warm or fn)()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternating(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of ``fns`` called ``rounds`` times, the engines taking turns within each round and the
    order reversed every other round, so that a drifting machine hits them alike; each name's values
    in round order."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            runs[name].append(fns[name]())
    return runs


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
