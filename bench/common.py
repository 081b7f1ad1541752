"""What every benchmark shares: timing (median over repeats), machine info, result rows, output."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Result:
    name: str
    ours: float
    baseline: float
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("nan")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["ratio"] = round(self.ratio, 4)
        return d


@dataclass
class Report:
    command: str
    results: list[Result] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "machine": machine(), "results": [r.to_dict() for r in self.results],
                **self.extra}

    def print_table(self) -> None:
        w = max([len(r.name) for r in self.results] + [10])
        print(f"{'benchmark':<{w}}  {'ours':>12}  {'baseline':>12}  {'ratio':>7}  unit")
        for r in self.results:
            print(f"{r.name:<{w}}  {r.ours:>12.2f}  {r.baseline:>12.2f}  {r.ratio:>7.3f}  {r.unit}"
                  f"{'  (' + r.note + ')' if r.note else ''}")
        for k, v in self.extra.items():
            print(f"{k}: {json.dumps(v)}")


def machine() -> dict[str, object]:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
