"""Helm values ``parallel`` (the layout the worker groups are sized for): shown in the NOTES with the
job's `parallel:` block, refused at render time when a degree is not a power of two or an NPU worker
group is too small for it (naming the value)."""

from __future__ import annotations

import json

import pytest

PROFILES = {"default": (), "cpu": ("values-cpu.yaml",), "npu": ("values-npu.yaml",)}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_default_layout_renders_and_is_in_the_notes(render, profile: str) -> None:
    notes = render(*PROFILES[profile]).notes
    layout = {"placement": "pack", "rollout": {"ep": 1, "tp": 1}, "trainer": {"dp": 1, "ep": 1, "tp": 1}}
    assert f"sized for `parallel: {json.dumps(layout, separators=(',', ':'))}`" in notes


def test_a_layout_that_fits_the_npus_renders(render) -> None:
    # default profile: 8 NPUs per trainer node, maxReplicas 2 -> 16 = tp 16
    r = render(**{"parallel.trainer": {"tp": 16, "ep": 2, "dp": 1}, "ray.workers.trainer.maxReplicas": 2,
                  "parallel.rollout": {"tp": 8, "ep": 8}})
    assert '"trainer":{"dp":1,"ep":2,"tp":16}' in r.notes


@pytest.mark.parametrize(("override", "message"), [
    ({"parallel.trainer.dp": 3}, r"parallel\.trainer\.dp must be a power of two between 1 and 1024, got 3"),
    ({"parallel.rollout.tp": 0}, r"parallel\.rollout\.tp must be a power of two"),
    ({"parallel.trainer.ep": 2048}, r"parallel\.trainer\.ep must be a power of two"),
    ({"parallel.trainer.dp": 2, "parallel.trainer.tp": 8},
     r"parallel\.trainer\.dp=2 cannot be combined with tp=8, ep=1"),
    ({"parallel.trainer.tp": 16},
     r"parallel\.trainer needs 16 NPUs \(max\(tp, ep\) or dp\) but ray\.workers\.trainer offers 8"),
    ({"parallel.rollout.ep": 16}, r"parallel\.rollout needs 16 NPUs .* ray\.workers\.rollout offers 8"),
    ({"parallel.placement": "strict_pack", "parallel.rollout.tp": 4, "parallel.trainer.tp": 8},
     r"parallel\.placement=strict_pack puts a job's ranks on one node, but the rollout and trainer need 12 NPUs"
     r" and the largest worker pod offers 8"),
    ({"parallel.placement": "anywhere"}, r"/parallel/placement': value must be one of 'pack', 'spread'"),
])
def test_bad_layouts_are_refused_naming_the_value(render, override: dict, message: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match=message):
        render(**override)


def test_ranks_may_span_pods_unless_strict_pack(render) -> None:
    # 8 NPUs a pod: rollout tp 4 + trainer tp 4 fit one pod; tp 8 each span pods, fine unless strict_pack
    assert '"placement":"strict_pack"' in render(**{"parallel.placement": "strict_pack", "parallel.rollout.tp": 4,
                                                     "parallel.trainer.tp": 4}).notes
    assert '"placement":"spread"' in render(**{"parallel.placement": "spread", "parallel.rollout.tp": 8,
                                                "parallel.trainer.tp": 8}).notes


def test_cpu_groups_have_no_npu_capacity_to_check(render) -> None:
    r = render("values-cpu.yaml", **{"parallel.trainer.dp": 64})
    assert '"dp":64' in r.notes
