"""Each algorithm's step through the GRPO loop against real in-process role servers (no Ray): the
loss knobs reach the trainer, and with consistent kernels a TIS correction measures every weight at
exactly 1 (nothing truncated) while the event carries the entropy, the LR of the schedule and the
dynamic-sampling count."""

from __future__ import annotations

from pathlib import Path

import pytest

from onpolicy.jobs.spec import load_spec_file, parse_spec
from onpolicy.services.controller.controller import job_inputs
from onpolicy.services.controller.loop import GRPOLoop, RoleStubs
from onpolicy.trainer.grpo import scheduled_lr

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("algorithm", ["gspo", "dapo", "dr-grpo"])
def test_an_algorithm_step_with_tis_is_exact_on_policy(stubs: RoleStubs, tmp_path: Path, algorithm: str) -> None:
    data = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    data = {k: v for k, v in data.items() if k not in ("grpo", "algorithm", "correction")}
    data.update(algorithm=algorithm, steps=4, correction={"mode": "tis", "threshold": 1.5},
                grpo={"group_size": 4, "prompts_per_step": 2, "lr": 1e-3, "entropy_coef": 0.01,
                      "lr_schedule": "cosine", "warmup_steps": 1, "max_sampling_rounds": 2})
    spec = parse_spec(data)
    loop = GRPOLoop("job-a", spec, stubs, job_inputs(spec)[0], tmp_path, lambda ev: None, lambda: False)
    ev = loop.step(2)
    assert ev.logdiff_max == 0.0 and ev.tokens_mismatched == 0 and ev.tokens_checked > 0
    assert ev.correction_fraction == 0.0 and ev.entropy > 0
    assert ev.lr == scheduled_lr(1e-3, 2, 4, "cosine", 1) < 1e-3
    if algorithm == "dapo":  # dynamic sampling drew from the data cursor: a round per kept-or-not batch
        assert loop.cursor in (2, 4) and ev.groups_dropped <= 2 * (loop.cursor // 2)
    else:
        assert loop.cursor == 0 and ev.groups_dropped == 0
