"""``onpolicy report JOB_ID --out FILE.png``: the job's per-step curves as a PNG, from the controller's
state directory (``events.jsonl``) or, with ``--address``, from a running JobService."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import fail
from .remote import add_connection_args, job_stub, rpc_error


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot a job's per-step curves (reward, eval, loss, KL, logdiff, ...) as a PNG")
    p.add_argument("job_id")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--state-dir", help="read the job's events.jsonl under this controller state directory "
                                       "(default: ask the JobService at --address)")
    add_connection_args(p)
    p.set_defaults(func=run)


def events_from_state(state_dir: Path, job_id: str) -> list[dict[str, Any]]:
    path = state_dir / "jobs" / job_id / "events.jsonl"
    if not path.is_file():
        fail(f"{job_id}: no job in {state_dir}")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-append (the store skips it too)
    return out


def events_from_service(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The job's events so far: the stream's past events (a running job's stream is left after a
    second without a new event)."""
    import grpc

    from onpolicy.services import api
    from onpolicy.services.controller.convert import event_dict

    stub = job_stub(args)
    out: list[dict[str, Any]] = []
    stream = stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=args.job_id))
    try:
        while True:
            nxt = _next_within(stream, 1.0)
            if nxt is None:
                break
            out.append(event_dict(nxt.event))
    except grpc.RpcError as e:
        fail(rpc_error(e, args.address))
    finally:
        stream.cancel()
    return out


def _next_within(stream: Any, seconds: float) -> Any:
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(next, stream, None).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        return None
    finally:
        pool.shutdown(wait=False)


def run(args: argparse.Namespace) -> int:
    from onpolicy.jobs.plots import plot_events

    if not args.out.endswith(".png"):
        fail(f"--out {args.out}: give a .png file")
    events = events_from_state(Path(args.state_dir), args.job_id) if args.state_dir else events_from_service(args)
    try:
        out = plot_events(events, Path(args.out), f"job {args.job_id}")
    except ValueError as e:
        fail(f"{args.job_id}: {e}")
    except OSError as e:
        fail(f"--out {args.out}: cannot write it ({e.strerror or e})")
    print(out, file=sys.stdout)
    return 0
