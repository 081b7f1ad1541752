"""``python -m onpolicy.bench.experiment_mismatch --replot DATE``: redraws the arms' curves from their
raw JSON without running a job (the experiment itself runs by hand, not in CI); no results for the
date is a usage error naming the files it looked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onpolicy.bench.experiment_mismatch import ARMS, COLOURS, main


def _events(kl: float) -> list[dict]:
    return [{"step": s, "weight_version": s, "state": "JOB_STATE_RUNNING", "reward_mean": 0.1 * s, "kl_k3": kl,
             "logdiff_mean": kl, "logdiff_max": 10 * kl, "grad_norm": 1.0, "clip_fraction": 0.0, "entropy": 2.0}
            for s in (1, 2, 3)]


def test_replot_draws_every_arm_from_its_json(tmp_path: Path) -> None:
    assert set(COLOURS) == set(ARMS)  # one fixed colour per arm
    for arm, kl in (("consistent", 0.0), ("fast", 2e-3)):
        (tmp_path / f"mismatch-2026-12-03-{arm}.json").write_text(json.dumps({"arm": arm, "events": _events(kl)}))
    assert main(["--replot", "2026-12-03", "--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    png = (tmp_path / "mismatch.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_replot_without_results_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--replot", "2026-01-01", "--results", str(tmp_path), "--out", str(tmp_path)])
    assert e.value.code == 2
    assert f"no results to plot: {tmp_path}/mismatch-2026-01-01-<arm>.json" in capsys.readouterr().err
