"""What ``check_supported`` (SubmitJob) refuses among the parallel degrees, naming the field: a trainer
both data and tensor/expert parallel, rollout degrees on an external engine, and rollout or trainer
degrees the model's shapes do not admit; degrees the model admits are accepted."""

from __future__ import annotations

import pytest

from onpolicy.jobs.spec import SpecError, parse_spec
from onpolicy.services.controller.controller import check_supported


@pytest.mark.parametrize(("spec", "field", "text"), [
    ({"parallel": {"trainer": {"tp": 2, "dp": 2}}}, "parallel.trainer.dp", "not both at once"),
    ({"parallel": {"trainer": {"ep": 2}}}, "parallel.trainer.ep", "needs a mixture-of-experts model"),
    ({"parallel": {"trainer": {"tp": 64}}}, "parallel.trainer.tp", "tp=64"),
    ({"parallel": {"rollout": {"ep": 2}}}, "parallel.rollout.ep", "needs a mixture-of-experts model"),
    ({"parallel": {"rollout": {"tp": 64}}}, "parallel.rollout.tp", "tp=64"),
    ({"parallel": {"rollout": {"tp": 2}}, "rollout": {"engine": "vllm-ascend"}, "kernels": {"backend": "ascend"},
      "resources": {"rollout": {"npus": 1}}}, "parallel.rollout.tp", "vllm-ascend"),
])
def test_refused_degrees_name_the_field(tiny_paths: object, spec: dict, field: str, text: str) -> None:
    with pytest.raises(SpecError) as e:
        check_supported(parse_spec({"model": "tiny-qwen3", **spec}))
    (got, desc), = e.value.violations
    assert got == field and text in desc


@pytest.mark.parametrize("spec", [{"parallel": {"rollout": {"tp": 2}}},
                                  {"model": "tiny-qwen3-moe", "parallel": {"rollout": {"tp": 2, "ep": 2}}},
                                  {"parallel": {"trainer": {"dp": 2}}},
                                  {"parallel": {"trainer": {"tp": 4}}},
                                  {"model": "tiny-qwen3-moe", "parallel": {"trainer": {"tp": 2, "ep": 2}}}])
def test_wired_degrees_are_accepted(tiny_paths: object, spec: dict) -> None:
    check_supported(parse_spec({"model": "tiny-qwen3", **spec}))
