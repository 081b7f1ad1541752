"""A job's placement group (``services.cluster.placement.reserve``): one bundle per rank of every role,
``parallel.placement`` as its strategy, validated in the spec and kept through the proto; a job the
cluster cannot hold fails with a ``PlacementError`` naming what it asks for, and leaves nothing
reserved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from onpolicy.jobs.spec import SpecError, load_spec_file, parse_spec
from onpolicy.services.cluster.placement import STRATEGIES, rank_resources, role_worlds
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
from onpolicy.services.controller.records import JobState

ROOT = Path(__file__).resolve().parents[3]


def _spec(**over: Any):
    raw = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    for key, value in over.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(raw)


def test_placement_is_validated_and_kept_through_the_proto() -> None:
    assert _spec().parallel.placement == "pack"
    for name in STRATEGIES:
        assert spec_from_proto(spec_to_proto(_spec(parallel={"placement": name}))).parallel.placement == name
    with pytest.raises(SpecError) as e:
        _spec(parallel={"placement": "anywhere"})
    assert "parallel.placement" in [f for f, _ in e.value.violations]


def test_every_rank_of_every_role_has_a_bundle() -> None:
    assert role_worlds(_spec()) == {"rollout": 1, "trainer": 1, "verifier": 1}
    tp = _spec(parallel={"rollout": {"tp": 2}, "trainer": {"tp": 2}})
    assert role_worlds(tp) == {"rollout": 2, "trainer": 2, "verifier": 1}
    dp = _spec(parallel={"trainer": {"dp": 4}})
    assert role_worlds(dp)["trainer"] == 4
    # a vLLM rollout runs its own workers inside its service: one rank for the placement group
    assert role_worlds(_spec(rollout={"engine": "vllm"}, parallel={"rollout": {"tp": 2}}))["rollout"] == 1
    assert rank_resources(0.5, 0, 0) == {"CPU": 0.5}
    assert rank_resources(0.0, 0, 0) == {"CPU": 0.01}  # a bundle is never empty
    assert rank_resources(0.5, 0, 1) == {"CPU": 1.0}  # a peer rank runs at least one thread
    assert rank_resources(2.0, 1, 1) == {"CPU": 2.0, "NPU": 1.0}


def test_a_job_the_cluster_cannot_hold_fails_naming_what_it_asks_for(ray_cluster: None, tmp_path: Path) -> None:
    from ray.util import placement_group_table

    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController

    ctl = JobController(tmp_path, RayLauncher(placement_timeout_s=2.0))
    try:
        job_id = ctl.submit(_spec(resources={"trainer": {"cpus": 64}})).job_id
        rec = ctl.wait(job_id, timeout=120)
    finally:
        ctl.shutdown()
    assert rec.state is JobState.FAILED
    assert rec.error.startswith("PlacementError: the cluster cannot place the job's 3 ranks (PACK: 66 CPUs)"), rec.error
    mine = [g for g in placement_group_table().values() if g["name"] == f"onpolicy-{job_id}"]
    assert mine and all(g["state"] == "REMOVED" for g in mine)
