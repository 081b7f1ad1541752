"""``onpolicy bench gemm`` (also ``python -m onpolicy.bench.gemm``): GFLOP/s of the reference
backend's linear kernel (``rowdot``, ``kernels/cpu/rowdot.c``) against ``torch.mm`` (MKL), the
measured FMA peak, and a candidate single-chain order (``bench/outer_gemm.c``).

Shapes are SmolLM2-135M's linears (``K x N``: 576x576 q/o, 576x1536 gate/up, 1536x576 down, and the
576x49152 LM head), at M = 1, 2, 4, 8, 32, 256, 1024 rows (the LM head up to 256), fp32 and bf16
weights (fp32 activations), on 1 and 2 threads. Timed for each:

- ``rowdot``: the weight as torch holds it (``[N, K]``); ``rowdot_packed``: the packed copy a decode
  step reads (``cpu.pack``);
- ``torch_mm``: ``torch.mm`` on the fp32 weight (torch's bf16 GEMM is far slower on CPUs without bf16
  instructions, so the fp32 GEMM is the fair baseline);
- ``outer``: the candidate, each output ONE fused multiply-add chain over k in order from +0, as an
  outer-product GEMM that packs the weight per call; ``outer_packed`` (up to 8 rows): its decode form
  on a copy packed once. Before timing, the benchmark checks the candidate's bits: the same on its
  AVX2 and portable paths, for a row alone and in a batch, on 1 and 2 threads, packed or not, and
  different from rowdot's order.

The peak is ``bench/fma_peak.c`` (12 independent 8-wide FMA chains per thread), the better of a
measurement before and one after the kernels. The kernels of one
size are timed in alternating rounds and each reports the median, so a shared machine's drifting
load hits them alike; caches are warm (the weights are re-read from L2/L3, not from DRAM).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the kernels load only when a benchmark runs, so `onpolicy --help` stays fast
    from torch import Tensor

    from .common import Report

SHAPES = {"qo_576x576": (576, 576), "gate_up_576x1536": (576, 1536), "down_1536x576": (1536, 576),
          "lm_head_576x49152": (576, 49152)}
ROWS = (1, 2, 4, 8, 32, 256, 1024)
LM_HEAD_MAX_ROWS = 256
#: Most rows the candidate's decode form (one row at a time against the packed copy) is timed for.
DECODE_ROWS = 8


def fma_peak(threads: int) -> float:
    """GFLOP/s of ``bench/fma_peak.c`` on ``threads`` threads."""
    from onpolicy.kernels import cpu

    src = Path(__file__).with_name("fma_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "fma_peak"
        subprocess.run([cpu.compiler(), "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
    return float(out.split()[0])


_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@functools.cache
def outer_library() -> ctypes.CDLL:
    """``bench/outer_gemm.c`` built with the native kernels' flags (and torch's OpenMP runtime)."""
    import torch

    from onpolicy.kernels import cpu

    src = Path(__file__).with_name("outer_gemm.c")
    out = Path(tempfile.mkdtemp(prefix="onpolicy-outer-gemm-")) / "outer_gemm.so"
    torch_lib = Path(torch.__file__).parent / "lib"
    subprocess.run([cpu.compiler(), *cpu.CFLAGS, str(src), "-o", str(out), f"-L{torch_lib}",
                    f"-Wl,-rpath,{torch_lib}", "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.outer_gemm_portable.argtypes = [_PTR, _I64, _PTR, _INT, _I64, _I64, _PTR, _I64, _I64, _I64]
    lib.outer_gemm_portable.restype = None
    lib.outer_pack.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR]
    lib.outer_pack.restype = None
    if cpu.vector_path():  # the AVX2 entry points exist in x86 builds only
        lib.outer_gemm_avx2.argtypes = [_PTR, _I64, _PTR, _INT, _I64, _I64, _PTR, _I64, _I64, _I64, _INT]
        lib.outer_gemm_avx2.restype = _INT
        lib.outer_gemv_packed.argtypes = [_PTR, _I64, _PTR, _INT, _I64, _PTR, _I64, _I64, _I64, _INT]
        lib.outer_gemv_packed.restype = None
    return lib


def outer_gemm(x: Tensor, w: Tensor, *, portable: bool = False, threads: int = 1) -> Tensor:
    """``x [M, K]`` (fp32) by ``w [N, K]`` (fp32 or bf16), each output one FMA chain over k: on the
    AVX2 path, or the portable one when asked or when this CPU has no AVX2+FMA."""
    import torch

    from onpolicy.kernels import cpu

    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n)
    bf16 = int(w.dtype == torch.bfloat16)
    if portable or not cpu.vector_path():
        outer_library().outer_gemm_portable(x.data_ptr(), k, w.data_ptr(), bf16, k, k, y.data_ptr(), n, m, n)
    elif outer_library().outer_gemm_avx2(x.data_ptr(), k, w.data_ptr(), bf16, k, k, y.data_ptr(), n, m, n,
                                         threads):
        raise MemoryError("outer_gemm: no scratch memory")
    return y


def outer_pack(w: Tensor) -> Tensor:
    """``w`` packed once for :func:`outer_gemv_packed`."""
    import torch

    n, k = w.shape
    out = torch.empty(-(-n // 16) * 16 * k, dtype=w.dtype)
    outer_library().outer_pack(w.data_ptr(), int(w.dtype == torch.bfloat16), k, n, k, out.data_ptr())
    return out


def outer_gemv_packed(x: Tensor, packed: Tensor, n: int, *, threads: int = 1) -> Tensor:
    """``outer_gemm(x, w)`` from ``outer_pack(w)`` (``n`` rows of w), one row of x at a time (AVX2 only)."""
    import torch

    from onpolicy.kernels import cpu

    if not cpu.vector_path():
        raise RuntimeError("outer_gemv_packed runs on the AVX2 path only")
    m, k = x.shape
    y = torch.empty(m, n)
    outer_library().outer_gemv_packed(x.data_ptr(), k, packed.data_ptr(), int(packed.dtype == torch.bfloat16), k,
                                      y.data_ptr(), n, m, n, threads)
    return y


def check_outer_bits(x: Tensor, w: Tensor, packed: Tensor) -> list[str]:
    """Where the candidate's bits depend on the path, the batch, the threads or the packing (none
    expected); and whether they differ from rowdot's order (expected: another order)."""
    import torch

    from onpolicy.kernels import cpu

    full = outer_gemm(x, w, threads=2)
    fails = []
    checks: dict[str, Callable[[], bool]] = {
        "portable": lambda: torch.equal(outer_gemm(x[:2], w, portable=True), full[:2]),
        "row alone": lambda: torch.equal(outer_gemm(x[5:6], w), full[5:6]),
        "1 thread": lambda: torch.equal(outer_gemm(x, w, threads=1), full),
        "packed decode": lambda: torch.equal(outer_gemv_packed(x[:4], packed, w.shape[0], threads=2), full[:4]),
    }
    if not cpu.vector_path():  # one path only: nothing to compare it with but rowdot
        checks = {}
    for name, same in checks.items():
        if not same():
            fails.append(name)
    if torch.equal(cpu.rowdot(x, w), full):
        fails.append("identical to rowdot's order (expected to differ)")
    return fails


ROUNDS = 3


def _repeats(flops: float) -> int:
    return max(3, min(60, int(7e8 / flops)))


def interleaved(fns: dict[str, Callable[[], object]], flops: float) -> dict[str, float]:
    """GFLOP/s of each of ``fns`` (one size's kernels), timed in ``ROUNDS`` alternating rounds: the
    median over rounds of each round's median time."""
    from .common import median_time

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(median_time(fn, _repeats(flops)))
    return {name: flops / statistics.median(ts) / 1e9 for name, ts in times.items()}


def summary(records: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per thread count and M: the geometric mean over shapes and weight dtypes of the candidate's
    GFLOP/s over rowdot's (and of the packed forms', where both were timed)."""
    out: dict[str, dict[str, float]] = {}
    pairs = (("outer/rowdot", "outer", "rowdot"), ("outer_packed/rowdot_packed", "outer_packed", "rowdot_packed"),
             ("rowdot/torch_mm", "rowdot", "torch_mm"))
    for key, a, b in pairs:
        groups: dict[str, list[float]] = {}
        for r in records:
            if a in r and b in r:
                groups.setdefault(f"t{r['threads']}/m{r['M']}", []).append(float(r[a]) / float(r[b]))  # type: ignore[arg-type]
        out[key] = {g: round(math.exp(sum(map(math.log, v)) / len(v)), 3) for g, v in groups.items()}
    return out


def kernels(x: Tensor, w: Tensor, packed: list[tuple[Tensor, int]] | None, opacked: Tensor,
            threads: int) -> dict[str, Callable[[], object]]:
    """The calls timed for one size: rowdot (plain, packed), torch.mm on the fp32 weight (read
    transposed, as ``F.linear`` reads it), the candidate (plain; packed for a decode step's rows)."""
    import torch

    from onpolicy.kernels import cpu

    wf, n = w.float(), w.shape[0]
    fns: dict[str, Callable[[], object]] = {"rowdot": lambda: cpu.rowdot(x, w)}
    if packed is not None:
        fns["rowdot_packed"] = lambda: cpu.rowdot_packed(x, packed)
    fns["torch_mm"] = lambda: torch.mm(x, wf.t())
    fns["outer"] = lambda: outer_gemm(x, w, threads=threads)
    if x.shape[0] <= DECODE_ROWS:
        fns["outer_packed"] = lambda: outer_gemv_packed(x, opacked, n, threads=threads)
    return fns


def measure(threads: int, rows: tuple[int, ...]) -> list[dict[str, object]]:
    """One record per (shape, weight dtype, rows): GFLOP/s of rowdot, rowdot_packed, torch.mm and the
    single-chain candidate (per-call packing, and the decode form on a copy packed once)."""
    import torch

    from onpolicy.kernels import cpu

    from .common import log

    torch.set_num_threads(threads)
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w32 = torch.randn(n, k, generator=gen) * k ** -0.5
        for wdtype in (torch.float32, torch.bfloat16):
            w = w32.to(wdtype)
            packed = [(cpu.pack(w), n)] if cpu.packable(w) else None
            opacked = outer_pack(w)
            fails = check_outer_bits(torch.randn(64, k, generator=gen), w, opacked)
            if fails:
                raise AssertionError(f"outer_gemm {name} {wdtype}: bits depend on {fails}")
            for m in rows:
                if name.startswith("lm_head") and m > LM_HEAD_MAX_ROWS:
                    continue
                x = torch.randn(m, k, generator=gen)
                flops = 2.0 * m * n * k
                rec: dict[str, object] = {"shape": name, "K": k, "N": n, "M": m, "weight": str(wdtype)[6:],
                                          "threads": threads}
                rec.update(interleaved(kernels(x, w, packed, opacked, threads), flops))
                log(json.dumps({a: (round(b, 1) if isinstance(b, float) else b) for a, b in rec.items()}))
                out.append(rec)
    return out


def run_gemm(threads: list[int], rows: tuple[int, ...], command: str) -> Report:
    """The report of one run: a result per (shape, M, weight dtype, threads) — rowdot vs torch.mm —
    the peaks, the summary, and (``details.records``) every number."""
    from onpolicy.kernels import cpu

    from .common import Report, Result

    t0 = time.perf_counter()
    report = Report(command)
    load_before = os.getloadavg()  # another process on the machine shows here (2 threads on 2 cores suffer most)
    peaks = {t: fma_peak(t) for t in threads}
    records = [r for t in threads for r in measure(t, rows)]
    peaks = {t: max(p, fma_peak(t)) for t, p in peaks.items()}  # measured again: a busy moment lowers one run
    for r in records:
        label = f"gemm/{r['shape']}/m{r['M']}/{r['weight']}/t{r['threads']}"
        note = f"single chain {r['outer']:.1f}"
        if "rowdot_packed" in r:
            note += f"; packed: rowdot {r['rowdot_packed']:.1f}"
        if "outer_packed" in r:
            note += f", single chain {r['outer_packed']:.1f}"
        report.results.append(Result(label, float(r["rowdot"]), float(r["torch_mm"]), "GFLOP/s", note))  # type: ignore[arg-type]
    report.details = {"fma_peak_gflops": peaks, "vector_path": cpu.vector_path(), "summary": summary(records),
                      "loadavg_before_after": [load_before, os.getloadavg()], "records": records}
    report.seconds = time.perf_counter() - t0
    return report


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be comma-separated integers >= 1")
    return values


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="comma-separated M (default 1,2,4,8,32,256,1024)")


def add_parser(benches: argparse._SubParsersAction) -> None:
    """``onpolicy bench gemm [--threads 1,2] [--rows ...] [--json]``."""

    text = "GFLOP/s of the reference linear (rowdot) vs torch.mm (MKL), the FMA peak and the single-chain order"
    b = benches.add_parser("gemm", help=text, description=text)
    _options(b)
    b.add_argument("--json", action="store_true", help="JSON for machines instead of the table")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from onpolicy.cli.common import emit_json, fail

    try:
        threads, rows = _int_list(args.threads, "--threads"), tuple(_int_list(args.rows, "--rows"))
    except ValueError as e:
        fail(str(e))
    report = run_gemm(threads, rows, f"onpolicy bench gemm --threads {args.threads} --rows {args.rows}")
    if args.json:
        emit_json(report.to_dict())
    else:
        _print(report)
    return 0


def _print(report: Report) -> None:
    """The table, without the per-record numbers (JSON only)."""
    records = report.details.pop("records")
    report.print_table()
    report.details["records"] = records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m onpolicy.bench.gemm", description=__doc__.split("\n\n")[0])
    _options(p)
    p.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    rows = tuple(int(m) for m in args.rows.split(","))
    report = run_gemm(threads, rows, f"python -m onpolicy.bench.gemm --threads {args.threads} --rows {args.rows}")
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=1) + "\n")


if __name__ == "__main__":
    main()
