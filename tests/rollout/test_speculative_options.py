"""``rollout.speculative`` / ``rollout.num_speculative_tokens`` in the job spec and its proto, the
rollout role's options, and ``--speculative`` / ``--num-speculative-tokens`` on ``onpolicy generate``
(run as a user would: a subprocess on the real engine); the rollout service built from the role's
options serves the same completions over gRPC and exports the draft counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onpolicy.jobs.spec import SpecError, parse_spec
from onpolicy.kernels import KernelConfig
from onpolicy.rollout import EngineConfig
from onpolicy.rollout.speculative import SpeculativeConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.role_metrics import RolloutMetrics
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
from onpolicy.services.roles import RolloutOptions, options_for, start_role

CLI = [sys.executable, "-m", "onpolicy.cli.main"]


def onpolicy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


def test_spec_fields_default_round_trip_and_reach_the_rollout_role() -> None:
    assert parse_spec({"model": "tiny-qwen3"}).rollout.speculative == "none"
    spec = parse_spec({"model": "tiny-qwen3", "rollout": {"speculative": "ngram", "num_speculative_tokens": 6}})
    msg = spec_to_proto(spec)
    assert msg.rollout.HasField("speculative") and msg.rollout.num_speculative_tokens == 6
    assert spec_from_proto(msg) == spec
    opts = options_for(spec, "rollout")
    assert opts.engine_config.speculative == SpeculativeConfig(method="ngram", num_tokens=6)


@pytest.mark.parametrize("rollout, field", [
    ({"speculative": "eagle"}, "rollout.speculative"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, "rollout.num_speculative_tokens"),
    ({"speculative": "ngram", "engine": "vllm"}, "rollout.speculative"),
])
def test_bad_speculative_specs_name_the_field(rollout: dict, field: str) -> None:
    msg = api.jobs_pb2.JobSpec(model="tiny-qwen3", rollout=api.jobs_pb2.RolloutSpec(**rollout))
    with pytest.raises(SpecError) as e:
        spec_from_proto(msg)
    assert field in str(e.value)


def _serve_generate(opts: RolloutOptions, req: object) -> tuple[list, dict[str, float]]:
    role = start_role(opts)
    servicer, server = role.servicer, role.server
    channel = connect(server.address)
    try:
        comps = [r.completion for r in api.rollout_pb2_grpc.RolloutServiceStub(channel).Generate(req, timeout=300)]
    finally:
        channel.close()
        server.stop(grace=0)
    counters = {s.name: s.value for fam in RolloutMetrics(servicer).collect() for s in fam.samples
                if s.name.startswith("onpolicy_rollout_spec_")}
    return comps, counters


def test_rollout_role_serves_speculative_completions_bitwise(tmp_home: Path) -> None:
    req = api.rollout_pb2.GenerateRequest(
        prompts=[api.rollout_pb2.Prompt(prompt_ids=[5, 6, 7, 8] * 4), api.rollout_pb2.Prompt(prompt_ids=[9, 40, 3])],
        params=api.rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=24, n=1, ignore_eos=True))
    kernels = KernelConfig(kv_tile=16)
    plain, plain_counters = _serve_generate(RolloutOptions(model="tiny-qwen3", kernels=kernels), req)
    spec, counters = _serve_generate(RolloutOptions(model="tiny-qwen3", kernels=kernels, engine_config=EngineConfig(
        max_num_seqs=64, speculative=SpeculativeConfig(method="ngram", num_tokens=3))), req)
    assert plain_counters["onpolicy_rollout_spec_drafted_tokens_total"] == 0
    drafted = counters["onpolicy_rollout_spec_drafted_tokens_total"]
    assert drafted >= counters["onpolicy_rollout_spec_accepted_tokens_total"] > 0
    assert len(plain) == len(spec) == 2
    for a, b in zip(plain, spec, strict=True):
        assert list(a.token_ids) == list(b.token_ids) and list(a.logprobs) == list(b.logprobs)


def test_generate_speculative_json_is_bitwise_plain(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]}\n{"prompt_ids": [9, 40, 3]}\n')
    common = ["generate", "--model", "tiny-qwen3", "--prompts", str(prompts), "--max-new-tokens", "24",
              "--temperature", "0", "--json"]
    plain = onpolicy(*common)
    spec = onpolicy(*common, "--speculative", "ngram", "--num-speculative-tokens", "3")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert "speculative" not in a and b["speculative"]["method"] == "ngram"
    assert b["speculative"]["drafted"] >= b["speculative"]["accepted"] > 0
    assert a["completions"] == b["completions"]  # tokens and exact logprob floats


@pytest.mark.parametrize("args, needle", [
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--speculative", "ngram", "--engine", "vllm"], "--speculative ngram: needs --engine onpolicy"),
])
def test_generate_bad_speculative_flags_exit_2(args: list[str], needle: str) -> None:
    proc = onpolicy("generate", "--model", "tiny-llama", "--prompt", "x", *args)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_speculative_reports_bitwise_equal_rows() -> None:
    proc = onpolicy("bench", "speculative", "--model", "tiny-qwen3", "--batches", "1,2", "--workloads", "copy,random",
                    "--prompt-len", "16", "--new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = [r["name"] for r in report["results"]]
    assert names == [f"speculative/{w}/bs{b}/fp32" for w in ("copy", "random") for b in (1, 2)]
    rows = report["details"]["speculative"]
    assert all(rows[n]["bitwise_equal"] for n in names)
    assert all(r["ours"] > 0 and r["baseline"] > 0 and r["unit"] == "tok/s" for r in report["results"])
    assert sum(rows[n]["accepted"] for n in names) > 0


def test_bench_speculative_bad_flags_exit_2() -> None:
    proc = onpolicy("bench", "speculative", "--model", "tiny-qwen3", "--workloads", "copy,poetry")
    assert proc.returncode == 2 and "poetry is not one of" in proc.stderr and "Traceback" not in proc.stderr
