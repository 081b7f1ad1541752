"""``onpolicy bench load``: many concurrent Generate streams against one rollout service on loopback.

Starts a rollout service in this process (real gRPC server, bearer token, the service's own
admission control), then ``--clients`` threads each send ``--requests`` Generate calls one after
another (``--n`` samples of a ``--prompt-len``-token prompt, ``--new-tokens`` generated, EOS
ignored). Reported: latency p50/p99 of the admitted calls (submit to last completion), throughput
(completions and generated tokens per second of wall time), calls refused RESOURCE_EXHAUSTED (by
the gate, or by the server's bound on RPCs held at once, ``--max-concurrent-rpcs``), the
most token positions in flight and calls queued at the gate (sampled), and the process's peak RSS
before and after the load (memory stays bounded by the gate, not by the client count). CPU timings
on a shared machine are noisy; the rejected count and the bounds are the point.
"""

from __future__ import annotations

import argparse
import resource
import threading
import time
from dataclasses import asdict, dataclass


@dataclass
class LoadResult:
    clients: int
    calls: int
    ok: int
    rejected: int
    other_errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    completions_per_s: float
    tokens_per_s: float
    max_inflight_tokens: int
    """The gate's bound (token positions)."""
    peak_inflight_tokens: int
    max_queued_requests: int
    peak_queued: int
    aborted_sequences: int
    rss_mib_before: float
    rss_mib_after: float
    command: str = ""

    def print_table(self) -> None:
        print(self.command)
        rows = [("clients x calls", f"{self.clients} x {self.calls // max(1, self.clients)}"),
                ("admitted / rejected / other errors", f"{self.ok} / {self.rejected} / {self.other_errors}"),
                ("latency p50 / p99", f"{self.p50_ms:.0f} ms / {self.p99_ms:.0f} ms"),
                ("throughput", f"{self.completions_per_s:.1f} completions/s, {self.tokens_per_s:.0f} tokens/s"),
                ("positions in flight (peak / bound)", f"{self.peak_inflight_tokens} / {self.max_inflight_tokens}"),
                ("calls queued (peak / bound)", f"{self.peak_queued} / {self.max_queued_requests}"),
                ("peak RSS before / after", f"{self.rss_mib_before:.0f} MiB / {self.rss_mib_after:.0f} MiB"),
                ("wall time", f"{self.seconds:.1f} s")]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def run_load(*, model: str = "tiny-qwen3", clients: int = 32, requests: int = 4, prompt_len: int = 16,
             new_tokens: int = 16, n: int = 1, max_inflight_tokens: int | None = None,
             max_queued_requests: int = 8, max_num_seqs: int = 64, max_concurrent_rpcs: int | None = 256,
             command: str = "") -> LoadResult:
    import grpc

    from onpolicy.kernels import KernelConfig
    from onpolicy.rollout import EngineConfig
    from onpolicy.services import api
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.roles import serve_servicer
    from onpolicy.services.rollout.service import build_rollout_service

    token = "bench-load-token"
    servicer = build_rollout_service(model, KernelConfig(), EngineConfig(max_num_seqs=max_num_seqs))
    if max_inflight_tokens is not None:
        servicer.admission.max_inflight_tokens = max_inflight_tokens
    servicer.admission.max_queued_requests = max_queued_requests
    gate = servicer.admission
    server = serve_servicer("rollout", servicer, ServerConfig(host="127.0.0.1", port=0, token=token,
                                                  max_concurrent_rpcs=max_concurrent_rpcs))
    channel = connect(server.address, token=token)
    rss_before = _rss_mib()  # model, KV cache and server up: what the load adds comes after
    stub = api.rollout_pb2_grpc.RolloutServiceStub(channel)
    vocab = servicer.lm.config.vocab_size
    latencies: list[float] = []
    counts = {"ok": 0, "rejected": 0, "other": 0, "tokens": 0}
    lock, done = threading.Lock(), threading.Event()
    peaks = {"inflight": 0, "queued": 0}

    def client(c: int) -> None:
        for r in range(requests):
            prompt = [(7 * c + 3 * r + i) % (vocab - 1) + 1 for i in range(prompt_len)]
            req = api.rollout_pb2.GenerateRequest(
                prompts=[api.rollout_pb2.Prompt(prompt_ids=prompt)],
                params=api.rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n,
                                                      seed=c * 1000 + r, ignore_eos=True))
            t0 = time.perf_counter()
            try:
                comps = [x.completion for x in stub.Generate(req, timeout=600)]
            except grpc.RpcError as e:
                with lock:
                    counts["rejected" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "other"] += 1
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                counts["ok"] += 1
                counts["tokens"] += sum(len(x.token_ids) for x in comps)

    def sample() -> None:
        while not done.wait(0.01):
            peaks["inflight"] = max(peaks["inflight"], gate.inflight_tokens)
            peaks["queued"] = max(peaks["queued"], gate.queued)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        done.set()
        channel.close()
        server.stop(grace=0)
    return LoadResult(
        clients=clients, calls=clients * requests, ok=counts["ok"], rejected=counts["rejected"],
        other_errors=counts["other"], seconds=seconds, p50_ms=1e3 * percentile(latencies, 0.50),
        p99_ms=1e3 * percentile(latencies, 0.99), completions_per_s=counts["ok"] * n / seconds,
        tokens_per_s=counts["tokens"] / seconds, max_inflight_tokens=gate.max_inflight_tokens,
        peak_inflight_tokens=peaks["inflight"], max_queued_requests=gate.max_queued_requests,
        peak_queued=peaks["queued"], aborted_sequences=servicer.worker.aborted_sequences,
        rss_mib_before=rss_before, rss_mib_after=_rss_mib(), command=command)


def add_parser(benches: argparse._SubParsersAction) -> None:
    text = "N concurrent Generate clients against one rollout service: p50/p99 latency, throughput, rejections"
    b = benches.add_parser("load", help=text, description=text)
    b.add_argument("--model", default="tiny-qwen3", help="model of the rollout service (default tiny-qwen3)")
    b.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    b.add_argument("--requests", type=int, default=4, help="Generate calls per client, one after another (default 4)")
    b.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    b.add_argument("--new-tokens", type=int, default=16, help="generated tokens per sample (default 16)")
    b.add_argument("--n", type=int, default=1, help="samples per call (default 1)")
    b.add_argument("--max-inflight-tokens", type=int,
                   help="admission bound in token positions (default: the service's, twice its KV cache)")
    b.add_argument("--max-queued", type=int, default=8, help="calls queued beyond the bound (default 8)")
    b.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size (default 64)")
    b.add_argument("--max-concurrent-rpcs", type=int, default=256,
                   help="RPCs the server holds at once, running or waiting for one of its 16 handler threads "
                        "(default 256)")
    b.add_argument("--json", action="store_true", help="JSON for machines instead of the table")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from onpolicy.cli.common import emit_json, fail

    for opt in ("clients", "requests", "prompt_len", "new_tokens", "n", "max_num_seqs", "max_concurrent_rpcs"):
        if getattr(args, opt) < 1:
            fail(f"--{opt.replace('_', '-')} must be >= 1")
    if args.max_queued < 0 or (args.max_inflight_tokens is not None and args.max_inflight_tokens < 1):
        fail("--max-queued must be >= 0 and --max-inflight-tokens >= 1")
    command = "onpolicy " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "onpolicy bench load"
    try:
        result = run_load(model=args.model, clients=args.clients, requests=args.requests, prompt_len=args.prompt_len,
                          new_tokens=args.new_tokens, n=args.n, max_inflight_tokens=args.max_inflight_tokens,
                          max_queued_requests=args.max_queued, max_num_seqs=args.max_num_seqs,
                          max_concurrent_rpcs=args.max_concurrent_rpcs, command=command)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e).splitlines()[0])
    if args.json:
        emit_json(asdict(result))
    else:
        result.print_table()
    return 0

