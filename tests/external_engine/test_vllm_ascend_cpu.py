"""CPU tests of the optional vllm-ascend rollout engine (``onpolicy.rollout.external``): nothing
NPU-only is imported, the job spec's ``rollout.engine`` is validated and reaches the rollout role,
asking for the engine where it is not installed fails clearly (FAILED_PRECONDITION over gRPC, exit 2
in the CLI), and the glue that runs our operators inside vLLM computes, on the reference backend,
bit for bit what our own rollout engine and trainer compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from onpolicy.jobs.spec import SpecError, parse_spec
from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, get_backend
from onpolicy.rollout import SamplingParams
from onpolicy.rollout.external import ENGINES, EngineUnavailable, check_engine
from onpolicy.rollout.external.vllm_ascend import (
    REQUIRED_MODULES,
    SampleRequest,
    completion_from_output,
    missing_modules,
    page_size_for,
    sample_seed,
    stop_ids,
)
from onpolicy.rollout.external.vllm_ascend_ops import (
    PAD_SLOT_ID,
    attention_batch,
    matmul_overrides,
    rms_norm_forward,
    rope_forward,
    silu_and_mul_forward,
    vllm_paged_attention,
    write_kv_cache,
)

unavailable_here = pytest.mark.skipif(missing_modules() != list(REQUIRED_MODULES),
                                      reason="vllm-ascend is installed here: the unavailability paths do not apply")

NPU_ONLY = ("vllm", "vllm_ascend", "torch_npu")
VLLM_SPEC = {"model": "tiny-llama", "rollout": {"engine": "vllm-ascend"}, "kernels": {"backend": "ascend"},
             "resources": {"rollout": {"npus": 1}}}


# -- nothing NPU-only is imported ------------------------------------------------------------------


@unavailable_here
def test_importing_every_onpolicy_module_imports_no_vllm_or_torch_npu() -> None:
    code = f"""
import importlib, pkgutil, sys, json
import onpolicy, onpolicy.bench, onpolicy.kernels, onpolicy.services
skip = ("onpolicy.services.generated",)
names = [m.name for pkg in (onpolicy, onpolicy.kernels, onpolicy.services, onpolicy.bench)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.startswith(skip)]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {NPU_ONLY!r})
print(json.dumps({{"modules": len(names), "loaded": loaded}}))
"""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["modules"] > 120  # onpolicy/, kernels/, services/, bench/: adapter and glue included


# -- job spec --------------------------------------------------------------------------------------


def test_spec_engine_defaults_to_ours_and_accepts_vllm_ascend_on_npus() -> None:
    assert parse_spec({}).rollout.engine == "onpolicy"
    assert parse_spec(VLLM_SPEC).rollout.engine == "vllm-ascend"
    assert ENGINES == ("onpolicy", "vllm-ascend")


@pytest.mark.parametrize(("data", "fields"), [
    ({"rollout": {"engine": "vllm"}}, ["rollout.engine"]),
    ({"rollout": {"engine": "vllm-ascend"}}, ["rollout"]),  # the default model smollm2 is GGUF
    ({**VLLM_SPEC, "kernels": {}, "resources": {}}, ["kernels", "resources"]),
    ({**VLLM_SPEC, "model": "/models/x.gguf"}, ["rollout"]),
    ({**VLLM_SPEC, "kernels": {"backend": "reference"}}, ["kernels"]),
    ({**VLLM_SPEC, "resources": {"rollout": {"npus": 0}}}, ["resources"]),
    ({**VLLM_SPEC, "rollout": {"engine": "vllm-ascend", "kernels": "fast"}}, ["rollout"]),
])
def test_spec_refuses_an_engine_it_cannot_run(data: dict, fields: list[str]) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert [f for f, _ in e.value.violations] == fields


def test_spec_engine_travels_in_the_proto_and_reaches_the_rollout_role_only() -> None:
    from onpolicy.services.cluster.actors import role_options
    from onpolicy.services.jobs.convert import spec_from_proto, spec_to_proto

    spec = parse_spec(VLLM_SPEC)
    msg = spec_to_proto(spec)
    assert msg.rollout.engine == "vllm-ascend"
    assert spec_from_proto(msg) == spec
    assert spec_from_proto(spec_to_proto(parse_spec({}))).rollout.engine == "onpolicy"
    opts = {role: role_options(spec, role) for role in ("rollout", "trainer", "verifier")}
    assert opts["rollout"]["engine"] == "vllm-ascend" and opts["rollout"]["backend"] == "ascend"
    assert opts["trainer"]["engine"] == opts["verifier"]["engine"] == "onpolicy"


# -- unavailable here: clear errors ----------------------------------------------------------------


@unavailable_here
def test_check_engine_names_what_is_missing() -> None:
    check_engine("onpolicy")
    with pytest.raises(EngineUnavailable, match="torch_npu, vllm, vllm_ascend"):
        check_engine("vllm-ascend")
    with pytest.raises(ValueError, match="unknown rollout engine"):
        check_engine("sglang")


@unavailable_here
def test_rollout_service_refuses_before_loading_a_model() -> None:
    from onpolicy.services.roles import RoleOptions, build_role_servicer

    opts = RoleOptions(model="no-such-model", backend="ascend", engine="vllm-ascend")
    with pytest.raises(EngineUnavailable, match="needs torch_npu"):  # not "unknown model": checked first
        build_role_servicer("rollout", opts)


@unavailable_here
def test_submit_job_answers_failed_precondition(tmp_path: Path) -> None:
    from onpolicy.services import api
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import GrpcServer, ServerConfig
    from onpolicy.services.jobs.controller import JobController
    from onpolicy.services.jobs.convert import spec_to_proto
    from onpolicy.services.jobs.servicer import JobServicer
    from onpolicy.services.roles import SERVICE_NAMES

    controller = JobController(tmp_path, RayLauncher(host="127.0.0.1"))  # role services would run here
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0))
    server.add_service(SERVICE_NAMES["jobs"], JobServicer(controller),
                       api.jobs_pb2_grpc.add_JobServiceServicer_to_server)
    server.start()
    try:
        with connect(server.address) as channel:
            stub = api.jobs_pb2_grpc.JobServiceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(parse_spec(VLLM_SPEC))), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "vllm-ascend needs torch_npu, vllm, vllm_ascend" in e.value.details()
            assert stub.ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=30).jobs == []  # nothing was started
    finally:
        server.stop(grace=0)
        controller.shutdown()


@unavailable_here
def test_serve_rollout_with_vllm_ascend_exits_2_with_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, ONPOLICY_HOME=str(tmp_path), RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "serve", "rollout", "--engine", "vllm-ascend",
                           "--model", "tiny-llama", "--port", "0"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm-ascend needs torch_npu, vllm, vllm_ascend" in lines[0]


# -- request mapping -------------------------------------------------------------------------------


def test_sample_seeds_depend_on_the_request_only() -> None:
    p = SamplingParams(seed=7, n=3)
    seeds = [sample_seed(p, i, [1, 2, 3]) for i in range(3)]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(SamplingParams(seed=7, n=1, temperature=0.5), 2, (1, 2, 3)) == seeds[2]
    assert sample_seed(p, 0, [1, 2, 4]) != seeds[0] and sample_seed(SamplingParams(seed=8), 0, [1, 2, 3]) != seeds[0]


def test_stop_ids_follow_our_engine() -> None:
    assert stop_ids(SamplingParams(stop_token_ids=(5, 3)), (2,)) == [2, 3, 5]
    assert stop_ids(SamplingParams(stop_token_ids=(5,), ignore_eos=True), (2,)) == [5]


def test_completion_from_output_keeps_fp32_logprobs_and_reasons() -> None:
    req = SampleRequest(prompt_index=4, sample_index=1, prompt_ids=(1, 2), params=SamplingParams(temperature=0))
    lp = torch.tensor([-0.1, -2.5, -1e-8], dtype=torch.float32).tolist()
    entries = [{7: SimpleNamespace(logprob=lp[0])},
               {9: SimpleNamespace(logprob=lp[1]), 3: SimpleNamespace(logprob=0.0)},
               {2: SimpleNamespace(logprob=lp[2])}]
    c = completion_from_output(req, [7, 9, 2], entries, "stop", weight_version=3)
    assert (c.prompt_index, c.sample_index, c.token_ids, c.weight_version) == (4, 1, (7, 9, 2), 3)
    assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), torch.tensor(lp, dtype=torch.float32))
    assert c.temperature == 1.0 and c.finish_reason == "stop"  # greedy: logprobs at temperature 1, as ours
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_output(req, [7], entries[:1], "abort", 0)


def test_page_size_is_a_multiple_of_the_kv_tile() -> None:
    from onpolicy.rollout import EngineConfig

    assert page_size_for(EngineConfig(), 64) == 128 and page_size_for(EngineConfig(), 256) == 256
    with pytest.raises(ValueError, match="multiple of the KV tile"):
        page_size_for(EngineConfig(page_size=96), 64)


# -- the glue computes what our engine and trainer compute (reference backend, bitwise) ------------

HQ, HKV, D, PAGE = 4, 2, 16, 32


@pytest.fixture(scope="module")
def backend():
    return get_backend(KernelConfig(kv_tile=16))


def test_write_kv_cache_fills_slots_and_skips_padding() -> None:
    k_cache, v_cache = torch.zeros(3, 4, HKV, D), torch.zeros(3, 4, HKV, D)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([9, PAD_SLOT_ID, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_attention_batch_from_vllm_metadata() -> None:
    batch, kept = attention_batch([0, 3, 4, 4, 6], [10, 7, 5, 2], "cpu")
    assert kept == [0, 1, 3]  # request 2 has no query rows (padding)
    assert batch.num_rows == 6 and batch.kv_lens.tolist() == [10, 7, 2]
    assert batch.q_pos[0, :3].tolist() == [7, 8, 9] and batch.q_pos[1, 0].item() == 6
    with pytest.raises(ValueError, match="S \\+ 1"):
        attention_batch([0, 1], [1, 1], "cpu")


def test_vllm_attention_equals_the_training_path_bitwise(backend) -> None:
    """A mixed vLLM step — a chunked prefill, two decodes, a fresh prefill — over a shuffled paged
    cache gives, for every query row, the bits our training forward gives for that token."""
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 33, 5, 40]  # final K/V positions of each sequence (crossing the KV tile and page)
    q_lens = [30, 1, 1, 40]  # tokens computed in this step: chunk, decode, decode, whole prompt
    ks = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    qs = [torch.randn(n, HQ, D, generator=gen) for n in lengths]
    pages_per_seq = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages_per_seq) + 2, generator=gen).tolist()  # physical pages, shuffled
    table = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    k_cache, v_cache = torch.zeros(len(order), PAGE, HKV, D), torch.zeros(len(order), PAGE, HKV, D)
    slots_of = []
    for s, n in enumerate(lengths):
        table[s, :pages_per_seq[s]] = torch.tensor([order.pop() for _ in range(pages_per_seq[s])], dtype=torch.int32)
        slots_of.append([int(table[s, p // PAGE]) * PAGE + p % PAGE for p in range(n)])
        done = n - q_lens[s]  # positions already in the cache from earlier steps
        write_kv_cache(ks[s][:done], vs[s][:done], k_cache, v_cache, torch.tensor(slots_of[s][:done]))
    new = [range(n - q, n) for n, q in zip(lengths, q_lens, strict=True)]
    query = torch.cat([qs[s][list(r)] for s, r in enumerate(new)] + [torch.zeros(3, HQ, D)])  # + padded rows
    key = torch.cat([ks[s][list(r)] for s, r in enumerate(new)] + [torch.zeros(3, HKV, D)])
    value = torch.cat([vs[s][list(r)] for s, r in enumerate(new)] + [torch.zeros(3, HKV, D)])
    slots = torch.tensor([slots_of[s][p] for s, r in enumerate(new) for p in r] + [PAD_SLOT_ID] * 3)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    n = sum(q_lens)
    out = vllm_paged_attention(backend, query, key, value, k_cache, v_cache, slots, qsl, torch.tensor(lengths),
                               table, 0.25, n)
    row = 0
    for s, length in enumerate(lengths):
        batch = AttentionBatch.build([length], [0], [length])
        train = backend.attention(qs[s], ContiguousKV(ks[s], vs[s], torch.tensor([0, length])), batch, 0.25)
        assert torch.equal(out[row:row + q_lens[s]], train[length - q_lens[s]:]), f"sequence {s}"
        row += q_lens[s]
    # a vLLM that stores K/V in its own op first: attention only reads the (now filled) cache
    again = vllm_paged_attention(backend, query, None, None, k_cache, v_cache, slots, qsl, torch.tensor(lengths),
                                 table, 0.25, n)
    assert torch.equal(again, out)


def test_matmul_overrides_are_our_linear_and_batch_invariant(backend) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(2, 13, 64, generator=gen)
    ops = matmul_overrides(backend)
    ours = backend.linear(x.reshape(-1, 64), w).reshape(2, 13, 48)
    assert torch.equal(ops["linear"](x, w), ours)
    assert torch.equal(ops["linear"](x, w, bias), ours + bias)
    assert torch.equal(ops["matmul"](x, w.t()), ours)
    assert torch.equal(ops["mm"](x[0], w.t()), ours[0])
    assert torch.equal(ops["addmm"](bias, x[1], w.t()), bias + ours[1])
    assert torch.equal(ops["linear"](x[1, 5:6], w), ours[1, 5:6])  # one row alone: the same bits
    with pytest.raises(NotImplementedError):
        ops["addmm"](bias, x[0], w.t(), beta=2)


def test_row_layers_are_our_model_code(backend) -> None:
    from onpolicy.models.causal_lm import rope_table

    gen = torch.Generator().manual_seed(2)
    x, res, w = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen), torch.randn(32, generator=gen)
    out, new_res = rms_norm_forward(backend, w, 1e-6, x, res)
    assert torch.equal(new_res, x + res) and torch.equal(out, backend.rmsnorm(x + res, w, 1e-6))
    assert torch.equal(rms_norm_forward(backend, w, 1e-6, x), backend.rmsnorm(x, w, 1e-6))
    gate_up = torch.randn(5, 64, generator=gen)
    assert torch.equal(silu_and_mul_forward(backend, gate_up), backend.swiglu(gate_up[:, :32], gate_up[:, 32:]))
    cos, sin = rope_table(D, 10000.0, 128)
    pos = torch.tensor([0, 3, 64, 65, 127])
    q, k = torch.randn(5, HQ * D, generator=gen), torch.randn(5, HKV * D, generator=gen)
    rq, rk = rope_forward(backend, cos, sin, D, pos, q, k)
    assert torch.equal(rq, backend.rope(q.view(5, HQ, D), cos[pos], sin[pos]).view(5, -1))
    assert rk is not None and torch.equal(rk, backend.rope(k.view(5, HKV, D), cos[pos], sin[pos]).view(5, -1))
