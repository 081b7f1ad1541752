"""The verifier on truncated (top-k / top-p / min-p) samples: a sample carries its truncation in the
``Completion`` message, the verifier recomputes the renormalised distribution the rollout sampled
(logdiff 0), and the same sample stripped of its truncation mismatches — recorded in the mismatch
store with its truncation, so the doctor replays it as the verifier scored it."""

from __future__ import annotations

import json

import pytest
from verifier_support import KV_TILE, MODEL, sample_msg, submit

from onpolicy.kernels.truncation import Truncation
from onpolicy.services.common.errors import InvalidArgument

TRUNC = Truncation(top_k=50, top_p=0.8, min_p=0.05)


@pytest.fixture(scope="module")
def truncated(load_tiny) -> list:
    from onpolicy.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(load_tiny(MODEL, kv_tile=KV_TILE))
    comps = engine.generate([[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13]],
                            SamplingParams(temperature=0.7, max_new_tokens=12, n=2, seed=11, ignore_eos=True,
                                           **TRUNC.to_dict()))
    return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))


def test_truncated_samples_verify_bitwise(make_servicer, truncated) -> None:
    msgs = [sample_msg(c, job="trunc") for c in truncated]
    assert all((m.completion.top_k, m.completion.top_p, m.completion.min_p)
               == (TRUNC.top_k, TRUNC.top_p, TRUNC.min_p) for m in msgs)  # fp32 values: exact in the proto
    res = submit(make_servicer(), msgs)
    assert res.accepted == len(truncated) and res.report.tokens_checked == sum(len(c.token_ids) for c in truncated)
    assert res.report.tokens_mismatched == 0 and res.report.max_abs_logdiff == 0.0 and res.report.kl_k3 == 0.0


def test_a_sample_without_its_truncation_mismatches_and_is_stored_replayable(make_servicer, truncated,
                                                                              tmp_path) -> None:
    msgs = [sample_msg(c, job="lost") for c in truncated]
    for m in msgs:  # an engine that truncated but did not report it
        m.completion.top_k, m.completion.top_p, m.completion.min_p = 0, 0.0, 0.0
    sv = make_servicer(mismatch_keep=2)
    res = submit(sv, msgs)
    assert res.report.tokens_mismatched == res.report.tokens_checked > 0 and res.report.max_abs_logdiff > 1e-3
    files = sorted((tmp_path / "mismatches" / "lost").glob("*.json"))
    assert files
    rec = json.loads(files[0].read_text())
    assert (rec["top_k"], rec["top_p"], rec["min_p"]) == (0, 1.0, 0.0)

    # stored with its truncation, a truncated sample's record replays it
    sv2 = make_servicer(mismatch_keep=2, mismatch_dir=str(tmp_path / "m2"))
    bad = [sample_msg(c, job="t2", logprobs=[x - 1e-3 for x in c.logprobs]) for c in truncated[:1]]
    submit(sv2, bad)
    (f,) = (tmp_path / "m2" / "t2").glob("*.json")
    rec = json.loads(f.read_text())
    assert (rec["top_k"], rec["top_p"], rec["min_p"]) == (TRUNC.top_k, TRUNC.top_p, TRUNC.min_p)
    assert rec["trainer_logprobs"] == list(truncated[0].logprobs)


def test_bad_truncation_is_invalid_argument(make_servicer, truncated) -> None:
    m = sample_msg(truncated[0])
    m.completion.top_p = 1.5
    with pytest.raises(InvalidArgument, match="top_p"):
        submit(make_servicer(), [m])
