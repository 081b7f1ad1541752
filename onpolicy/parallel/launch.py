"""Run one function on N local worker processes joined in a loopback gloo world.

``run_workers(fn, world, *args)`` spawns ``world`` processes (``spawn`` start method, so nothing
of the parent's state leaks in), each joins the world on a free ``127.0.0.1`` port and calls
``fn(rank, world, *args)``; the return values come back in rank order. Any rank raising, dying or
exceeding ``timeout_s`` fails the whole run with ``WorkerError`` naming the rank and its error; the
other ranks are terminated (and every collective has a timeout too, so a lost peer never hangs).
Results travel as ``torch.save`` bytes, so tensors need no shared memory between processes.
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from .groups import DEFAULT_TIMEOUT_S, LOOPBACK, Rendezvous, join_world


class WorkerError(RuntimeError):
    """A worker process failed, died or timed out."""


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, threads: int, timeout_s: float,
            results: Any, args: tuple[Any, ...]) -> None:
    try:
        torch.set_num_threads(threads)
        join_world(rank, world, Rendezvous(LOOPBACK, port), timeout_s)
        value = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort on the way out
            pass


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                threads: int = 1) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` computed by ``world`` processes.
    ``fn`` must be importable by name (a module-level function)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, threads, timeout_s, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:  # give a dying rank's report a moment to arrive before blaming the exit code
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        raise WorkerError(f"rank {dead[0]} of {world} exited with code {procs[dead[0]].exitcode} "
                                          "without a result") from None
                elif time.monotonic() > deadline:
                    raise WorkerError(f"{world - len(out)} of {world} ranks did not finish within "
                                      f"{timeout_s:.0f}s") from None
                else:
                    continue
            if not ok:
                last = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
                # a peer's death shows up on the survivors as a connection error: name the dead rank first
                time.sleep(0.5)
                silent = [r for r, p in enumerate(procs) if r != rank and r not in out and p.exitcode not in (None, 0)]
                cause = "".join(f"rank {r} of {world} exited with code {procs[r].exitcode} without a result; "
                                for r in silent)
                raise WorkerError(f"{cause}rank {rank} of {world} failed: {last}\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world)]
