"""``onpolicy up | serve | demo``: run the services (embedded local Ray by default)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from .common import fail, read_file_arg
from .remote import read_token


def add_server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port}; 0 = any free port)")
    p.add_argument("--token-file", help="require this bearer token on every RPC (default: $ONPOLICY_TOKEN if set)")
    p.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")


def add_metrics_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--metrics-port", type=int,
                   help=f"serve Prometheus /metrics of {what} on this port (0 = any free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics endpoint (default 127.0.0.1)")


def add_controller_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The job controller's options (``onpolicy up``, ``onpolicy serve jobs``)."""
    p.add_argument("--ray-address", help=f"{prefix}attach to this Ray cluster instead of starting one")
    p.add_argument("--service-host", default="127.0.0.1",
                   help=f"{prefix}address each job's role services bind (default 127.0.0.1; on a multi-node cluster "
                        "`node`: each binds its node's IP, as Ray reports it; 0.0.0.0: every interface, advertising "
                        "the node's IP)")
    p.add_argument("--state-dir", help=f"{prefix}controller state (default $ONPOLICY_HOME/controller)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help=f"{prefix}times Ray restarts a job's crashed role service; the job then resumes from its "
                        "last checkpoint (default 3)")
    p.add_argument("--max-running-jobs", type=int, default=None, metavar="N",
                   help=f"{prefix}jobs whose services run at once; later jobs wait PENDING in a queue (default: the "
                        "cluster's CPUs / 3, the CPUs of a job with the default resources)")
    p.add_argument("--max-watch-streams", type=int, default=64, metavar="N",
                   help=f"{prefix}open WatchJob streams served at once; beyond, RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--data-root", action="append", default=[], metavar="DIR",
                   help=f"{prefix}datasets (and checkpoint dirs) a job names must lie under one of these "
                        "(repeatable; default: anywhere)")
    p.add_argument("--model-root", action="append", default=[], metavar="DIR",
                   help=f"{prefix}model paths a job names must lie under one of these (repeatable; default: anywhere; "
                        "Hugging Face ids resolve in the HF cache)")
    p.add_argument("--role-tls-cert", metavar="PEM",
                   help=f"{prefix}mutual TLS to each job's role services: the certificate they serve and the "
                        "controller presents (readable at this path on every node)")
    p.add_argument("--role-tls-key", metavar="PEM", help=f"{prefix}private key of --role-tls-cert")
    p.add_argument("--role-tls-ca", metavar="PEM", help=f"{prefix}CA that signed --role-tls-cert")
    p.add_argument("--role-tls-name", default="onpolicy-roles",
                   help=f"{prefix}the name --role-tls-cert carries (checked instead of the node IP; "
                        "default onpolicy-roles)")
    p.add_argument("--allow-reward-modules", default="", metavar="PKG[,PKG...]",
                   help=f"{prefix}top-level packages installed here whose module:function rewards jobs may name "
                        "(default: none, only the registered rewards)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start Ray (embedded, loopback), the job controller and its JobService")
    add_server_args(p, 50051)
    add_metrics_args(p, "every job's rollout, trainer and verifier, merged")
    add_controller_args(p)
    p.add_argument("--model", help="certify the operator set for this model at start-up")
    p.set_defaults(func=up)
    p = sub.add_parser("serve", help="run one service standalone (jobs, rollout, trainer or verifier)")
    p.add_argument("role", choices=["jobs", "rollout", "trainer", "verifier"])
    add_server_args(p, 0)
    p.add_argument("--model", default="smollm2", help="model of a rollout/trainer/verifier service")
    p.add_argument("--kernels", default="consistent", help="consistent | fast (rollout only)")
    p.add_argument("--engine", choices=["onpolicy", "vllm", "vllm-ascend"], default="onpolicy",
                   help="rollout engine: vllm runs vLLM with our operators (scripts/setup.sh --vllm; --kernels fast: "
                        "vLLM's own kernels); vllm-ascend: the same on Ascend NPUs (its own image)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--kv-tile", type=int, default=64)
    add_controller_args(p, "jobs: ")
    add_metrics_args(p, "this service (jobs: every job's services, merged)")
    p.set_defaults(func=serve)
    from onpolicy.jobs.demo import DEMO_LR, DEMO_STEPS

    p = sub.add_parser("demo", help="run a GRPO job end to end on this machine (Ray, gRPC services, verifier)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"GRPO steps (default {DEMO_STEPS})")
    p.add_argument("--lr", type=float, default=DEMO_LR, help=f"learning rate (default {DEMO_LR:g})")
    p.add_argument("--seed", type=int, default=0, help="the job's sampling seed (default 0)")
    p.add_argument("--kernels", choices=["consistent", "fast"], default="consistent",
                   help="rollout kernels: fast shows the verifier catching a mismatch")
    p.add_argument("--engine", choices=["onpolicy", "vllm"], default="onpolicy",
                   help="rollout engine: vllm runs the rollout on vLLM with our operators (scripts/setup.sh --vllm)")
    p.add_argument("--state-dir", help="keep controller state here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per job event per line")
    add_metrics_args(p, "the demo job's services")
    p.set_defaults(func=demo)


def server_config(args: argparse.Namespace, token: str | None) -> Any:
    from onpolicy.services.common.server import ServerConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        fail("--tls-cert and --tls-key go together")
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            read_file_arg(value, flag)
    try:
        return ServerConfig(host=args.host, port=args.port, token=token, tls_cert=args.tls_cert,
                            tls_key=args.tls_key, tls_client_ca=args.tls_client_ca)
    except (ValueError, OSError) as e:
        fail(str(e))


def start_metrics(registry: Any, args: argparse.Namespace) -> Any:
    """A ``MetricsEndpoint`` for ``registry`` when ``--metrics-port`` was given, else None."""
    if getattr(args, "metrics_port", None) is None:
        return None
    from onpolicy.services.common.metrics_endpoint import MetricsEndpoint

    if not 0 <= args.metrics_port < 65536:
        fail(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    try:
        endpoint = MetricsEndpoint(registry, args.metrics_host, args.metrics_port)
    except OSError as e:
        fail(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {e.strerror or e}")
    print(f"metrics endpoint: {endpoint.url}", flush=True)
    return endpoint


def reward_modules(value: str) -> list[str]:
    """``--allow-reward-modules`` as package names (exit 2 on a malformed one)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    for n in names:
        if not n.isidentifier():
            fail(f"--allow-reward-modules: {n!r} is not a top-level package name")
    return names


def role_tls_arg(args: argparse.Namespace) -> Any:
    """``--role-tls-*`` as a ``RoleTLS`` (None without them; exit 2 when incomplete or missing)."""
    files = {"cert": args.role_tls_cert, "key": args.role_tls_key, "ca": args.role_tls_ca}
    if not any(files.values()):
        return None
    missing = [f"--role-tls-{k}" for k, v in files.items() if not v]
    if missing:
        fail(f"--role-tls-cert, --role-tls-key and --role-tls-ca go together (missing {', '.join(missing)})")
    for k, v in files.items():
        read_file_arg(v, f"--role-tls-{k}")
    from onpolicy.services.cluster.actors import RoleTLS

    return RoleTLS(server_name=args.role_tls_name, **files)


def state_dir_arg(value: str | None, default: Path) -> Path:
    """``--state-dir`` (or ``default``) as a directory that exists or can be made (exit 2 otherwise)."""
    path = Path(value) if value else default
    if path.exists() and not path.is_dir():
        fail(f"--state-dir {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--state-dir {path}: cannot create it ({e.strerror or e})")
    return path


def start_jobs_server(config: Any, state_dir: Path, ray_address: str | None, token: str | None,
                      metrics: Any = None, service_host: str = "127.0.0.1", max_restarts: int = 3,
                      allow_reward_modules: list[str] | None = None, max_running_jobs: int | None = None,
                      max_watch_streams: int = 64, data_roots: list[str] | None = None,
                      model_roots: list[str] | None = None, role_tls: Any = None) -> tuple[Any, Any]:
    """Ray + controller + JobService; returns (server, controller). ``metrics``: a ``MetricsHub``
    that every job's services register their /metrics with (the controller's own job metrics are
    added to it). ``service_host``: where the role services bind (0.0.0.0 on a multi-node cluster:
    they then advertise their node's IP)."""
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.cluster.local_ray import init_ray
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    if max_restarts < 0:
        fail(f"--max-restarts must be >= 0, got {max_restarts}")
    for flag, value in (("--max-running-jobs", max_running_jobs), ("--max-watch-streams", max_watch_streams)):
        if value is not None and value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    init_ray(ray_address)
    if max_running_jobs is None:
        import ray

        max_running_jobs = max(1, int(ray.cluster_resources().get("CPU", 3) // 3))
    controller = JobController(state_dir, RayLauncher(host=service_host, token=token, metrics=metrics,
                                                      state_dir=state_dir, max_restarts=max_restarts,
                                                      tls=role_tls),
                               allow_reward_modules=allow_reward_modules or (), max_running_jobs=max_running_jobs,
                               data_roots=data_roots or (), model_roots=model_roots or ())
    if metrics is not None:
        from onpolicy.services.controller.metrics import ControllerMetrics

        metrics.registry.register(ControllerMetrics(controller))
    try:
        server = jobs_server(controller, config, max_watch_streams)
    except RuntimeError as e:
        controller.shutdown()
        fail(str(e))
    resumed = controller.resume_unfinished()
    if resumed:
        print(f"resuming {len(resumed)} unfinished job(s): {', '.join(resumed)}", file=sys.stderr, flush=True)
    return server, controller


SHUTDOWN_DEADLINE_S = 120.0
"""Seconds a stopping ``up`` / ``serve`` gets before it prints every thread's stack and exits 1."""
JOB_STOP_S = 30.0
"""Of those, seconds the controller waits for its jobs' threads to end."""


def stop_on_signal() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM. That first signal puts both back to their default
    action, so a second one ends the process at once, whatever it is doing."""
    stop = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop


def wait_for(stop: threading.Event) -> None:
    """Block until ``stop`` (``stop_on_signal``); the shutdown that follows then has
    ``SHUTDOWN_DEADLINE_S`` seconds, after which the process prints where each thread was and exits
    1 (running jobs stay RUNNING on disk either way, and resume at the next start)."""
    stop.wait()
    print(f"shutting down (at most {SHUTDOWN_DEADLINE_S:.0f} s; signal again to exit now); running jobs stay "
          "resumable", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(SHUTDOWN_DEADLINE_S, exit=True)


def stop_all(server: Any, controller: Any, endpoint: Any, hub: Any) -> None:
    """Stop the controller's jobs (see ``JobController.shutdown``), the gRPC server, the metrics
    endpoint and this process's Ray connection (a local cluster goes down with it)."""
    from onpolicy.services.cluster.local_ray import shutdown_ray

    if controller is not None:
        stuck = controller.shutdown(JOB_STOP_S)
        if stuck:
            print(f"job(s) still stopping after {JOB_STOP_S:.0f} s: {', '.join(stuck)}", file=sys.stderr, flush=True)
    server.stop()
    close_metrics(endpoint, hub)
    shutdown_ray()


def default_state_dir() -> Path:
    return Path(os.environ.get("ONPOLICY_HOME", Path.home() / ".cache" / "onpolicy")) / "controller"


def up(args: argparse.Namespace) -> int:
    token = read_token(args.token_file)
    config = server_config(args, token)
    if args.model:
        from onpolicy.kernels import KernelConfig
        from onpolicy.services.common.model import load_certified

        load_certified(args.model, KernelConfig())
    hub = metrics_hub(args)
    endpoint = start_metrics(hub.registry, args) if hub is not None else None
    server, controller = start_jobs_server(config, state_dir_arg(args.state_dir, default_state_dir()),
                                           args.ray_address, token, hub, args.service_host, args.max_restarts,
                                           reward_modules(args.allow_reward_modules), args.max_running_jobs,
                                           args.max_watch_streams, args.data_root, args.model_root,
                                           role_tls_arg(args))
    stop = stop_on_signal()  # after Ray's start-up, which installs handlers of its own
    print(f"jobs endpoint: {server.address}", flush=True)
    try:
        wait_for(stop)
    finally:
        stop_all(server, controller, endpoint, hub)
    return 0


def metrics_hub(args: argparse.Namespace) -> Any:
    if getattr(args, "metrics_port", None) is None:
        return None
    from onpolicy.services.common.metrics_endpoint import MetricsHub

    return MetricsHub()


def close_metrics(endpoint: Any, hub: Any = None) -> None:
    if endpoint is not None:
        endpoint.close()
    if hub is not None:
        hub.close()


def serve(args: argparse.Namespace) -> int:
    token = read_token(args.token_file)
    config = server_config(args, token)
    hub = None
    if args.role == "jobs":
        hub = metrics_hub(args)
        endpoint = start_metrics(hub.registry, args) if hub is not None else None
        server, controller = start_jobs_server(config, state_dir_arg(args.state_dir, default_state_dir()),
                                               args.ray_address, token, hub, args.service_host, args.max_restarts,
                                               reward_modules(args.allow_reward_modules), args.max_running_jobs,
                                               args.max_watch_streams, args.data_root, args.model_root,
                                               role_tls_arg(args))
    else:
        from onpolicy.kernels import KernelConfig
        from onpolicy.rollout.engines import EngineUnavailable, check_engine
        from onpolicy.services.roles import ROLES, start_role

        backend = "fast" if args.kernels == "fast" else "reference"
        if args.engine != "onpolicy":
            if args.role != "rollout":
                fail(f"--engine {args.engine} applies to the rollout role only")
            try:
                check_engine(args.engine)
            except EngineUnavailable as e:
                fail(str(e))
            if args.engine == "vllm-ascend":
                if args.kernels == "fast":
                    fail("--engine vllm-ascend runs the onpolicy Ascend operators: --kernels fast does not apply")
                backend = "ascend"  # vLLM on Ascend runs our Ascend operators
        try:
            kernels = KernelConfig(backend=backend, compute_dtype=args.dtype, kv_tile=args.kv_tile)
        except ValueError as e:
            fail(str(e).splitlines()[0])
        extra = ({"engine": args.engine, "weights_kernels": kernels.with_(
            backend=backend if args.engine == "vllm-ascend" else "reference")} if args.role == "rollout" else {})
        opts = ROLES[args.role].options(model=args.model, kernels=kernels, **extra)
        if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
            fail(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
        try:
            role = start_role(opts, server_config=config,
                              metrics_host=args.metrics_host if args.metrics_port is not None else None,
                              metrics_port=args.metrics_port or 0)
        except OSError as e:
            fail(f"cannot serve {args.role}: {e.strerror or e}")
        except (ValueError, RuntimeError) as e:
            fail(str(e).splitlines()[0])
        server, controller, endpoint = role.server, None, role.metrics
        if endpoint is not None:
            print(f"metrics endpoint: {endpoint.url}", flush=True)
    stop = stop_on_signal()
    print(f"{args.role} endpoint: {server.address}", flush=True)
    try:
        wait_for(stop)
    finally:
        stop_all(server, controller, endpoint, hub)
    return 0


def demo(args: argparse.Namespace) -> int:
    import secrets

    import grpc

    from onpolicy.jobs.demo import demo_spec
    from onpolicy.jobs.spec import SpecError, parse_spec
    from onpolicy.services import api
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import check_inputs
    from onpolicy.services.controller.convert import spec_to_proto

    from .jobs_cmd import stream_events
    from .remote import rpc_error

    if args.steps < 1:
        fail("--steps must be >= 1")
    if args.engine != "onpolicy":
        from onpolicy.rollout.engines import EngineUnavailable, check_engine

        try:
            check_engine(args.engine)
        except EngineUnavailable as e:
            fail(str(e))
    try:
        spec = parse_spec(demo_spec(args.model, args.steps, args.kernels, args.engine, args.lr, args.seed))
        check_inputs(spec)  # before Ray starts: a model that resolves nowhere is one line, exit 2
    except SpecError as e:
        fail(str(e))
    token = secrets.token_urlsafe(24)  # the demo's services require a bearer token, like production
    state_dir = state_dir_arg(args.state_dir, Path(tempfile.mkdtemp(prefix="onpolicy-demo-")))

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    say(f"starting Ray (embedded, loopback), the job controller and its services for {args.model} ...")
    hub = metrics_hub(args)
    endpoint = start_metrics(hub.registry, args) if hub is not None else None
    server, controller = start_jobs_server(ServerConfig(port=0, token=token), state_dir, None, token, hub)
    try:
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=token))
        try:
            job = stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job
        except grpc.RpcError as e:
            fail(rpc_error(e, server.address))
        say(f"jobs endpoint {server.address}; submitted job {job.job_id}: GRPO on {args.model}, arithmetic task, "
            f"{args.steps} steps, rollout kernels {args.kernels}")
        final = stream_events(args, stub, job.job_id, args.steps)
        rec = controller.get(job.job_id)
        events = controller.store.load_all()
        mine = [e for r, evs in events if r.job_id == job.job_id for e in evs]
        steps = [e for e in mine if e.weight_version]
        evals = [e for e in mine if e.eval_accuracy is not None]
        mismatched = sum(e.tokens_mismatched for e in steps)
        checked = sum(e.tokens_checked for e in steps)
        if not args.json:
            say(f"job {job.job_id} {final}: {len(steps)} steps, {checked} tokens verified, {mismatched} mismatched"
                + (f" ({rec.error})" if rec.error else ""))
            if len(evals) >= 2:
                first, last = evals[0], evals[-1]
                say(f"eval accuracy (greedy, {last.eval_problems} held-out problems): step {first.step} "
                    f"{first.eval_accuracy:.3f} -> step {last.step} {last.eval_accuracy:.3f} "
                    f"({last.eval_accuracy - first.eval_accuracy:+.3f})")
            say(f"plot it: onpolicy report {job.job_id} --state-dir {state_dir} --out {job.job_id}.png")
        ok = final == "SUCCEEDED" and (mismatched == 0 or args.kernels == "fast")
        return 0 if ok else 1
    finally:
        stop_all(server, controller, endpoint, hub)
