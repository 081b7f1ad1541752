"""VerifierServicer on real completions of our rollout engine: metrics contents, back-pressure,
batched recompute, the rate cap, completions from external engines, and the mismatch store."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from verifier_support import sample_msg, scrape, submit, value

from onpolicy.services import api
from onpolicy.services.common.convert import weights_ref_to_proto
from onpolicy.verification import verifier as verifier_mod
from onpolicy.verification.mismatch_store import load_mismatch
from onpolicy.weights import export_weights


def n_tokens(comps) -> int:
    return sum(len(c.token_ids) for c in comps)


def test_wait_verifies_bitwise_and_exports_the_metrics(make_servicer, completions) -> None:
    sv = make_servicer()
    res = submit(sv, [sample_msg(c, job="job-a", step=3) for c in completions])
    total = n_tokens(completions)
    assert (res.accepted, res.dropped) == (len(completions), 0)
    assert res.report.tokens_checked == total and res.report.tokens_mismatched == 0
    assert res.report.max_abs_logdiff == 0.0 and res.report.sequences_checked == len(completions)

    m = scrape(sv.metrics.registry)
    job = {"job": "job-a", "model": "tiny-qwen3", "role": "verifier"}
    assert value(m, "onpolicy_tokens_checked_total", **job) == total
    assert value(m, "onpolicy_tokens_mismatched_total", **job) == 0
    assert value(m, "onpolicy_sequences_checked_total", **job) == len(completions)
    assert value(m, "onpolicy_logdiff_bucket", le="0", **job) == total  # every token in the zero bucket
    assert value(m, "onpolicy_logdiff_bucket", le="+Inf", **job) == total
    assert value(m, "onpolicy_logdiff_count", **job) == total and value(m, "onpolicy_logdiff_sum", **job) == 0
    assert value(m, "onpolicy_logdiff_max", **job) == 0 and value(m, "onpolicy_kl_k3", **job) == 0
    assert 0 <= value(m, "onpolicy_verification_lag_seconds", **job) < 60
    for reason in ("queue_full", "rate_limit", "stale_weights"):
        assert value(m, "onpolicy_samples_dropped_total", reason=reason, **job) == 0
    assert value(m, "onpolicy_weight_version", role="verifier") == 0
    cfg = sv.lm.model.ops.config
    assert value(m, "onpolicy_kernel_config_info", fingerprint=cfg.fingerprint, backend="reference", kv_tile="16",
                 dtype="fp32", role="verifier") == 1
    assert value(m, "onpolicy_verifier_recompute_batches_total") == 1
    report = sv.GetReport(api.verifier_pb2.GetReportRequest(job_id="job-a"), None).report
    assert report.tokens_checked == total and report.samples_dropped == 0
    # A second verifier in the same process has registries of its own: nothing collides or leaks.
    other = scrape(make_servicer().metrics.registry)
    assert ("onpolicy_tokens_checked_total", frozenset(job.items())) not in other


def wait_until_taken(sv) -> None:
    """Wait until the worker has taken what is queued (it then blocks on the busy verifier)."""
    deadline = time.monotonic() + 30
    while sv.queue.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sv.queue.depth == 0


def test_async_submissions_never_block_and_drops_are_counted(make_servicer, completions) -> None:
    sv = make_servicer(queue_samples=4, max_batch_samples=2)
    sv.verifier._compute.acquire()  # the verifier is busy: nothing queued can be verified
    try:
        accepted = dropped = 0
        checked_tokens = 0
        for i in range(10):
            if i == 1:
                wait_until_taken(sv)  # the worker holds the first pair, blocked
            pair = completions[(2 * i) % 8:(2 * i) % 8 + 2]
            t0 = time.perf_counter()
            res = submit(sv, [sample_msg(c, step=i) for c in pair], wait=False)
            assert time.perf_counter() - t0 < 0.5  # the caller is never slowed by the busy verifier
            assert res.accepted + res.dropped == 2
            accepted += res.accepted
            dropped += res.dropped
            checked_tokens += n_tokens(pair[:res.accepted])
        # The worker holds the first pair (blocked); the queue holds 4 more; the rest were dropped.
        assert (accepted, dropped) == (6, 14)
        m = scrape(sv.metrics.registry)
        assert value(m, "onpolicy_samples_dropped_total", reason="queue_full", job="job-a") == dropped
        assert value(m, "onpolicy_verifier_queue_samples") == 4
    finally:
        sv.verifier._compute.release()
    assert sv.flush(timeout=60)
    m = scrape(sv.metrics.registry)
    assert value(m, "onpolicy_tokens_checked_total", job="job-a") == checked_tokens
    assert value(m, "onpolicy_sequences_checked_total", job="job-a") == accepted
    assert value(m, "onpolicy_verifier_queue_samples") == 0
    report = sv.GetReport(api.verifier_pb2.GetReportRequest(job_id="job-a"), None).report
    assert report.samples_dropped == dropped and report.tokens_mismatched == 0


def test_queued_batches_are_recomputed_together(make_servicer, completions, monkeypatch) -> None:
    forwards: list[int] = []
    real = verifier_mod.sequence_logprobs

    def spy(model, seqs, **kw):
        forwards.append(len(seqs))
        return real(model, seqs, **kw)

    monkeypatch.setattr(verifier_mod, "sequence_logprobs", spy)
    sv = make_servicer()
    sv.verifier._compute.acquire()
    try:
        for i, c in enumerate(completions):  # 8 submissions of one sample each
            assert submit(sv, [sample_msg(c)], wait=False).accepted == 1
            if i == 0:
                wait_until_taken(sv)  # the worker holds the first one, blocked on the busy verifier
    finally:
        sv.verifier._compute.release()
    assert sv.flush(timeout=60)
    # The 7 submissions queued meanwhile were drained into one recompute (one call of the packed
    # training-path forward).
    assert forwards == [1, 7]
    m = scrape(sv.metrics.registry)
    assert value(m, "onpolicy_verifier_recompute_batches_total") == len(forwards)
    assert value(m, "onpolicy_tokens_checked_total", job="job-a") == n_tokens(completions)


def test_rate_cap_per_job(make_servicer, completions) -> None:
    sv = make_servicer(max_samples_per_second=0.001, burst_samples=3)  # no refill within the test
    res = submit(sv, [sample_msg(c, job="a") for c in completions[:5]])
    assert (res.accepted, res.dropped) == (3, 2) and res.report.sequences_checked == 3
    res = submit(sv, [sample_msg(c, job="b") for c in completions[:2]])  # another job's own budget
    assert (res.accepted, res.dropped) == (2, 0)
    res = submit(sv, [sample_msg(c, job="a") for c in completions[:2]], wait=False)
    assert (res.accepted, res.dropped) == (0, 2)
    m = scrape(sv.metrics.registry)
    assert value(m, "onpolicy_samples_dropped_total", reason="rate_limit", job="a") == 4
    assert value(m, "onpolicy_samples_dropped_total", reason="rate_limit", job="b") == 0
    assert value(m, "onpolicy_sequences_checked_total", job="a") == 3


def publish_base_weights_as(sv, version: int, directory: Path) -> None:
    lm = sv.lm
    ref = export_weights(lm.model.state_dict(), directory, version, lm.model.ops.fingerprint, lm.name)
    sv.UpdateWeights(api.verifier_pb2.VerifierServiceUpdateWeightsRequest(weights=weights_ref_to_proto(ref)), None)


PERTURB = {0: {2: 1e-3}, 1: {0: 1e-3, 5: -2.5e-2}, 3: {11: 1e-5}}
"""completion index -> {token index: amount added to its logprob}"""


def perturbed(completions) -> tuple[list[list[float]], int, float]:
    """Logprob lists with ``PERTURB`` applied in fp32, how many tokens changed, and the exact fp32
    max |perturbed − original| (the verifier's trainer logprobs equal the originals bit for bit)."""
    out, changed, worst = [], 0, 0.0
    for i, c in enumerate(completions):
        orig = torch.tensor(c.logprobs, dtype=torch.float32)
        lp = orig.clone()
        for j, delta in PERTURB.get(i, {}).items():
            lp[j] += delta
        changed += int((lp != orig).sum())
        worst = max(worst, float((lp - orig).abs().max()))
        out.append(lp.tolist())
    return out, changed, worst


def test_external_engine_samples_are_verified_at_current_weights(make_servicer, completions, tmp_path) -> None:
    sv = make_servicer(mismatch_keep=2)
    publish_base_weights_as(sv, 1, tmp_path / "weights")  # same weights, version 1
    assert submit(sv, [sample_msg(c, source="vllm") for c in completions]).report.tokens_mismatched == 0

    lps, changed, worst = perturbed(completions)
    assert changed == 4 and abs(worst - 2.5e-2) < 1e-6
    samples = [sample_msg(c, job="ext", step=5, source="vllm", logprobs=lp, weight_version=0)
               for c, lp in zip(completions, lps, strict=True)]
    res = submit(sv, samples)
    assert (res.accepted, res.dropped) == (8, 0)  # weight_version 0 from another engine = current
    assert res.report.tokens_mismatched == changed  # exactly the perturbed tokens
    assert res.report.max_abs_logdiff == worst  # the perturbation's exact fp32 magnitude
    m = scrape(sv.metrics.registry)
    assert value(m, "onpolicy_tokens_mismatched_total", job="ext") == changed
    assert value(m, "onpolicy_logdiff_max", job="ext") == worst
    assert value(m, "onpolicy_logdiff_bucket", le="0", job="ext") == n_tokens(completions) - changed
    assert value(m, "onpolicy_logdiff_bucket", le="0.01", job="ext") == n_tokens(completions) - 1
    assert value(m, "onpolicy_kl_k3", job="ext") > 0
    assert value(m, "onpolicy_weight_version") == 1

    # Our own rollout's samples carry exact versions: version 0 after the update is stale.
    res = submit(sv, [sample_msg(c, job="own", weight_version=0) for c in completions[:2]])
    assert (res.accepted, res.dropped) == (0, 2)
    assert value(scrape(sv.metrics.registry), "onpolicy_samples_dropped_total", reason="stale_weights",
                 job="own") == 2

    # The mismatch store kept the 2 worst samples of the job, replayable.
    paths = sv.verifier.mismatch_store.paths("ext")
    assert len(paths) == 2
    worst_rec, second = (load_mismatch(p) for p in paths)
    assert worst_rec.max_abs_logdiff == worst and worst_rec.first_mismatch_index == 0
    assert worst_rec.mismatched_tokens == 2 and second.mismatched_tokens == 1
    data = json.loads(paths[0].read_text())
    assert data["source"] == "vllm" and data["kernel_fingerprint"] == "" and data["weight_version"] == 1
    assert data["weights_path"].endswith("weights-v000001.safetensors") and data["model"] == "tiny-qwen3"
    assert data["job_id"] == "ext" and data["step"] == 5 and data["temperature"] == 1.0
    assert data["token_ids"] == list(completions[1].token_ids)
    assert data["trainer_logprobs"] == list(completions[1].logprobs)  # bitwise: the rollout's own values
    assert data["logprobs"] == lps[1]
    assert data["trainer_kernel_fingerprint"] == sv.lm.model.ops.config.fingerprint


@pytest.mark.parametrize("field,bad", [("logprobs", [float("nan")]), ("token_ids", [])])
def test_bad_samples_are_invalid_argument(make_servicer, completions, field, bad) -> None:
    from onpolicy.services.common.errors import InvalidArgument

    sv = make_servicer()
    msg = sample_msg(completions[0])
    comp = msg.completion
    del getattr(comp, field)[:]
    getattr(comp, field).extend(bad * len(completions[0].token_ids) if field == "logprobs" else bad)
    with pytest.raises(InvalidArgument):
        submit(sv, [msg])
