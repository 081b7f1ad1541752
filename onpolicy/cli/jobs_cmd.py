"""``onpolicy submit | watch | jobs | cancel``: talk to a running JobService over gRPC."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc

from .common import emit_json, fail
from .remote import add_connection_args, job_stub, rpc_error


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit an RL job (YAML spec) to the job service")
    p.add_argument("spec", help="job spec YAML (see examples/jobs/)")
    p.add_argument("--watch", action="store_true", help="stream the job's events until it ends")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(func=submit)
    p = sub.add_parser("watch", help="stream a job's events until it ends")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="one JSON object per event per line")
    add_connection_args(p)
    p.set_defaults(func=watch)
    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(func=list_jobs)
    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id")
    add_connection_args(p)
    p.set_defaults(func=cancel)


def state_name(value: int) -> str:
    from onpolicy.services import api

    return api.jobs_pb2.JobState.Name(value).removeprefix("JOB_STATE_")


def format_event(ev: Any, steps: int | None = None) -> str:
    state = state_name(ev.state)
    if ev.step and state == "RUNNING" and ev.weight_version:
        of = f"/{steps}" if steps else ""
        return (f"step {ev.step}{of}  reward {ev.reward_mean:.3f}±{ev.reward_std:.3f}  logdiff_max {ev.logdiff_max:g}  "
                f"tokens checked {ev.tokens_checked} mismatched {ev.tokens_mismatched}  weights v{ev.weight_version}  "
                f"loss {ev.loss:.4f}  rollout {ev.rollout_tokens_per_s:.0f} tok/s  "
                f"trainer {ev.trainer_tokens_per_s:.0f} tok/s  {ev.times.total_s:.1f}s"
                + (f"  eval {ev.eval_accuracy:.3f} ({ev.eval_problems})" if ev.HasField("eval_accuracy") else ""))
    return f"[{state}] {ev.message}"


def stream_events(args: argparse.Namespace, stub: Any, job_id: str, steps: int | None = None) -> str:
    """Print events until the job ends; returns the final state name."""
    from onpolicy.services import api
    from onpolicy.services.controller.convert import event_dict

    final = "UNKNOWN"
    for resp in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id)):
        ev = resp.event
        final = state_name(ev.state)
        if args.json:
            emit_json(event_dict(ev))
        else:
            print(format_event(ev, steps), flush=True)
    return final


def submit(args: argparse.Namespace) -> int:
    from onpolicy.jobs.spec import SpecError, load_spec_file
    from onpolicy.services import api
    from onpolicy.services.controller.convert import spec_to_proto

    try:
        spec = load_spec_file(args.spec)
    except SpecError as e:  # a file error names the file itself
        fail(e.violations[0][1] if e.violations[0][0] == "file" else f"{args.spec}: {e}")
    stub = job_stub(args)
    try:
        job = stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job
        if not args.json:
            print(f"submitted job {job.job_id} ({spec.model}, {spec.steps} steps)", file=sys.stderr, flush=True)
        elif not args.watch:
            emit_json({"job_id": job.job_id, "state": state_name(job.state)})
        if args.watch:
            final = stream_events(args, stub, job.job_id, spec.steps)
            return 0 if final == "SUCCEEDED" else 1
        if not args.json:
            print(job.job_id)
    except grpc.RpcError as e:
        fail(rpc_error(e, args.address))
    return 0


def watch(args: argparse.Namespace) -> int:
    stub = job_stub(args)
    try:
        final = stream_events(args, stub, args.job_id)
    except grpc.RpcError as e:
        fail(rpc_error(e, args.address))
    return 0 if final == "SUCCEEDED" else 1


def list_jobs(args: argparse.Namespace) -> int:
    from onpolicy.services import api

    try:
        jobs = job_stub(args).ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=30).jobs
    except grpc.RpcError as e:
        fail(rpc_error(e, args.address))
    if args.json:
        emit_json([{"job_id": j.job_id, "name": j.spec.name, "model": j.spec.model, "state": state_name(j.state),
                    "step": j.step, "steps": j.spec.steps, "error": j.error} for j in jobs])
        return 0
    print(f"{'JOB':<13} {'STATE':<10} {'STEP':>9}  {'MODEL':<16} {'CREATED':<19} NAME")
    for j in jobs:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created_at))
        print(f"{j.job_id:<13} {state_name(j.state):<10} {f'{j.step}/{j.spec.steps}':>9}  {j.spec.model:<16} "
              f"{created:<19} {j.spec.name}")
    return 0


def cancel(args: argparse.Namespace) -> int:
    from onpolicy.services import api

    try:
        job = job_stub(args).CancelJob(api.jobs_pb2.CancelJobRequest(job_id=args.job_id), timeout=30).job
    except grpc.RpcError as e:
        fail(rpc_error(e, args.address))
    print(f"{job.job_id}: {state_name(job.state)}")
    return 0
