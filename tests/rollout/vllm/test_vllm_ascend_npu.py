"""Hardware tests of the vLLM engine on Ascend (an Atlas 800 A2/A3 box in the ``vllm-ascend`` image:
CANN, torch_npu, vllm, vllm-ascend and the onpolicy Ascend operators; docs/ascend.md). Skipped
elsewhere. Until they have passed there, the engine on Ascend is unverified (on CPU it is verified
by test_vllm_engine.py).

* our operators are installed in every worker, on vllm-ascend's KV cache layout;
* the sampled tokens' logprobs equal our trainer's training path (Ascend backend) bit for bit, at
  temperature 1, 0.7 and greedy, and the verifier counts no mismatched token for them;
* a request's tokens and logprobs do not depend on the batch it ran in;
* a pushed weight version reaches vLLM (logprobs change, and still equal the trainer's), also as
  the loop pushes it: a safetensors version named in UpdateWeights to the rollout service over gRPC.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.loading import copy_weights_
from onpolicy.models.registry import load_model
from onpolicy.rollout import EngineConfig, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

NPU_REASON = "needs an Ascend NPU with CANN, torch_npu, vllm and vllm-ascend (the vllm-ascend image)"

pytestmark = [pytest.mark.npu, pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch_npu", "vllm", "vllm_ascend")), reason=NPU_REASON)]

MODEL = "tiny-llama-hd32"
CONFIG = KernelConfig(backend="ascend", compute_dtype="fp32", kv_tile=64)
PROMPTS = [[1, 5, 9, 200, 31], [7] * 70, [3, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 14]


@pytest.fixture(scope="module")
def engine():
    from onpolicy.rollout.vllm.engine import VllmEngine

    engine = VllmEngine(MODEL, CONFIG, EngineConfig(max_num_seqs=16, max_batched_tokens=256))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer_lm():
    """The trainer's side: our model on the Ascend backend (training path)."""
    return load_model(MODEL, get_backend(CONFIG))


def trainer_logprobs(lm, completions) -> list[torch.Tensor]:
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in completions]
    with torch.no_grad():
        return [t.float().cpu() for t in sequence_logprobs(lm.model, seqs)]


def assert_bitwise(completions, trainer) -> None:
    for c, t in zip(completions, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t), (c.prompt_index, c.sample_index)


def test_our_operators_are_installed_in_every_worker(engine) -> None:
    from onpolicy.kernels.ascend.env import env_mismatches

    assert env_mismatches() == {}
    layers = engine.lm.config.num_layers
    for report in engine.install_reports:
        counts = report["layers"]
        assert report["platform"] == "npu" and report["fingerprint"] == CONFIG.fingerprint
        assert counts["attention"] == layers and counts["rope"] >= 1 and counts["lm_head"] == 1
        assert counts["rms_norm"] == 2 * layers + 1 and counts["silu_and_mul"] == layers
        assert counts["row_linear"] == 2 * layers  # o_proj and down_proj: the canonical chunked reduction


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_the_training_path_bitwise(engine, trainer_lm, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_new_tokens=40, n=2, seed=3)
    comps = engine.generate(PROMPTS, params)
    assert len(comps) == len(PROMPTS) * 2 and all(c.weight_version == engine.weight_version for c in comps)
    assert_bitwise(comps, trainer_logprobs(trainer_lm, comps))


def test_the_verifier_counts_no_mismatch(engine, trainer_lm) -> None:
    from onpolicy.verification.verifier import Verifier, VerifySample

    comps = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, n=2, seed=11))
    samples = [VerifySample(job_id="npu", step=0, prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                            logprobs=c.logprobs, temperature=c.temperature, weight_version=0, source="vllm-ascend")
               for c in comps]
    stats = Verifier(trainer_lm).verify(samples).stats
    assert stats.tokens_checked == sum(len(c.token_ids) for c in comps)
    assert stats.mismatched_tokens == 0 and stats.max_abs_logdiff == 0


def test_a_request_does_not_depend_on_its_batch(engine) -> None:
    params = SamplingParams(max_new_tokens=32, seed=5)
    alone = engine.generate(PROMPTS[:1], params)[0]
    crowd = engine.generate([*PROMPTS[1:], PROMPTS[0], *PROMPTS[1:]], params)
    together = next(c for c in crowd if c.prompt_index == len(PROMPTS) - 1)
    assert together.token_ids == alone.token_ids
    assert torch.equal(torch.tensor(together.logprobs), torch.tensor(alone.logprobs))


def test_a_weight_version_reaches_vllm(engine, trainer_lm) -> None:
    params = SamplingParams(max_new_tokens=16, seed=9, temperature=0.0)
    before = engine.generate(PROMPTS, params)
    gen = torch.Generator().manual_seed(0)
    state = {k: v.detach().cpu().clone() for k, v in trainer_lm.model.state_dict().items()}
    for t in state.values():
        if t.is_floating_point() and t.dim() == 2:
            t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02)
    copy_weights_(trainer_lm.model, state)
    engine.update_weights(state, 1)
    after = engine.generate(PROMPTS, params)
    assert engine.weight_version == 1 and all(c.weight_version == 1 for c in after)
    assert any(a.logprobs != b.logprobs for a, b in zip(after, before, strict=True))
    assert_bitwise(after, trainer_logprobs(trainer_lm, after))


def test_a_weight_file_reaches_vllm_through_the_rollout_service(engine, trainer_lm, tmp_path) -> None:
    """The loop's path: a versioned safetensors file (as the trainer exports it) named in
    UpdateWeights over gRPC, then Generate — logprobs equal the trainer's on those weights. Last:
    stopping the server stops the engine's worker thread."""
    from onpolicy.services import api
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.convert import weights_ref_to_proto
    from onpolicy.services.roles import serve_servicer
    from onpolicy.services.rollout import RolloutServicer
    from onpolicy.weights import export_weights

    gen = torch.Generator().manual_seed(1)
    state = {k: v.detach().cpu().clone() for k, v in trainer_lm.model.state_dict().items()}
    for t in state.values():
        if t.is_floating_point() and t.dim() == 2:
            t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02)
    ref = export_weights(state, tmp_path, 2, CONFIG.fingerprint, MODEL)
    copy_weights_(trainer_lm.model, state)
    server = serve_servicer("rollout", RolloutServicer(engine, weights_fingerprint=CONFIG.fingerprint))
    try:
        with connect(server.address) as channel:
            stub = api.rollout_pb2_grpc.RolloutServiceStub(channel)
            done = stub.UpdateWeights(api.rollout_pb2.UpdateWeightsRequest(weights=weights_ref_to_proto(ref)),
                                      timeout=300)
            assert done.weight_version == 2
            info = stub.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest(), timeout=60).info
            assert info.weight_version == 2 and info.kernel_fingerprint == CONFIG.fingerprint
            request = api.rollout_pb2.GenerateRequest(
                prompts=[api.rollout_pb2.Prompt(prompt_ids=p) for p in PROMPTS],
                params=api.rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=4))
            comps = [r.completion for r in stub.Generate(request, timeout=600)]
    finally:
        server.stop(grace=0)
    assert len(comps) == 2 * len(PROMPTS) and all(c.weight_version == 2 for c in comps)
    trainer = trainer_logprobs(trainer_lm, [ScoredSequence(tuple(c.prompt_ids), tuple(c.token_ids), c.temperature)
                                            for c in comps])
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(list(c.logprobs), dtype=torch.float32), t)
