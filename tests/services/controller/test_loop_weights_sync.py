"""The GRPO loop against real in-process role servers (no Ray): weights really sync after a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.controller.controller import job_inputs
from onpolicy.services.controller.loop import GRPOLoop, RoleStubs

ROOT = Path(__file__).resolve().parents[3]


def fixed_prompt_logprobs(stubs: RoleStubs) -> list[float]:
    req = api.rollout_pb2.GenerateRequest(prompts=[api.rollout_pb2.Prompt(prompt_ids=[5, 6, 7, 8, 9] * 4)],
                                          params=api.rollout_pb2.SamplingParams(temperature=0, max_new_tokens=8,
                                                                                ignore_eos=True))
    return list(next(iter(stubs.rollout.Generate(req))).completion.logprobs)


def test_a_step_syncs_weights_to_rollout_and_verifier(stubs: RoleStubs, tmp_path: Path) -> None:
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_copy(update={"steps": 2})
    # weight decay moves every weight even when a step's advantages happen to be all zero
    spec = spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"recompute_old_logprobs": True,
                                                                        "weight_decay": 0.1})})
    events = []
    loop = GRPOLoop("job-x", spec, stubs, job_inputs(spec)[0], tmp_path, events.append, lambda: False)
    before = fixed_prompt_logprobs(stubs)
    ev = loop.step(0)
    after = fixed_prompt_logprobs(stubs)
    assert ev.weight_version == 1 and ev.logdiff_max == 0.0 and ev.tokens_checked > 0
    assert after != before, "rollout logprobs did not change: weights were not synced"
    r = stubs.rollout.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest()).info
    v = stubs.verifier.GetInfo(api.verifier_pb2.VerifierServiceGetInfoRequest()).info
    assert r.weight_version == v.weight_version == 1
    assert r.weight_sha256 == v.weight_sha256 and r.kernel_fingerprint == v.kernel_fingerprint
    # a malformed update (wrong checksum) is refused and the old weights stay
    ref = stubs.trainer.ExportWeights(api.trainer_pb2.ExportWeightsRequest(directory=str(tmp_path / "w"))).weights
    ref.sha256 = "0" * 64
    with pytest.raises(Exception, match="sha256"):
        stubs.rollout.UpdateWeights(api.rollout_pb2.UpdateWeightsRequest(weights=ref))
    assert fixed_prompt_logprobs(stubs) == after
    ev2 = loop.step(1)
    assert ev2.weight_version == 2 and ev2.tokens_mismatched == 0
