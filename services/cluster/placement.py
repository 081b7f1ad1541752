"""Placement of role services and their peer ranks: Ray resources (CPUs, Ascend NPUs), device
visibility, Kubernetes requests, and a job's placement group (``reserve``): one bundle per rank of
every role, reserved all together, so a job either has all of its ranks or waits and fails with the
reason (never half placed); a node lost later takes its bundles with it, and Ray places them again
where there is room.

Ray (>= 2.10) knows Ascend NPUs as the accelerator resource ``NPU`` and sets
``ASCEND_RT_VISIBLE_DEVICES`` for every task or actor that requests it, so inside an actor the
assigned NPUs are ``npu:0 .. npu:n-1``. On Kubernetes the Ascend device plugin exposes
``huawei.com/Ascend910`` and KubeRay passes ``{"NPU": n}`` to ``ray start``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NPU_RESOURCE = "NPU"
"""Ray resource name of Ascend NPUs."""
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
"""Device-visibility variable of the Ascend runtime (the ``CUDA_VISIBLE_DEVICES`` of NPUs)."""
NOSET_VISIBLE_DEVICES_ENV = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
"""When set to 1, Ray leaves ASCEND_RT_VISIBLE_DEVICES alone (the process manages it)."""
K8S_NPU_RESOURCE = "huawei.com/Ascend910"
"""Extended resource of the Ascend device plugin (Atlas 800 A2/A3 expose Ascend910 chips)."""


def _count(npus: int) -> int:
    if isinstance(npus, bool) or not isinstance(npus, int) or npus < 0:
        raise ValueError(f"npus must be a non-negative integer, got {npus!r}")
    return npus


def ray_resources(npus: int) -> dict[str, float]:
    """Custom resources for ``ray.remote(resources=...)``: ``{"NPU": n}``, or ``{}`` (CPU) for 0."""
    n = _count(npus)
    return {NPU_RESOURCE: float(n)} if n else {}


def actor_options(npus: int, num_cpus: float = 1.0) -> dict[str, object]:
    """Options for ``Actor.options(**actor_options(n))``: CPUs plus ``{"NPU": n}`` when n > 0."""
    if num_cpus < 0:
        raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
    options: dict[str, object] = {"num_cpus": num_cpus}
    resources = ray_resources(npus)
    if resources:
        options["resources"] = resources
    return options


def visible_devices_env(ids: Iterable[int | str]) -> dict[str, str]:
    """``{"ASCEND_RT_VISIBLE_DEVICES": "0,1"}`` for the given physical device ids (order kept)."""
    out: list[int] = []
    for raw in ids:
        try:
            i = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"NPU id must be an integer, got {raw!r}") from None
        if i < 0:
            raise ValueError(f"NPU id must be >= 0, got {i}")
        if i in out:
            raise ValueError(f"NPU id {i} listed twice")
        out.append(i)
    return {VISIBLE_DEVICES_ENV: ",".join(map(str, out))}


def parse_visible_devices(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The physical ids in ``ASCEND_RT_VISIBLE_DEVICES``, ``None`` when unset (all visible)."""
    value = (os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV)
    if value is None:
        return None
    value = value.strip()
    if value in ("", "NoDevFiles"):
        return []
    return [int(x) for x in value.split(",") if x.strip()]


def local_device(index: int = 0) -> str:
    """torch device string of the ``index``-th visible NPU (visibility renumbers from 0)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return f"npu:{index}"


def assigned_npu_ids() -> list[str]:
    """Inside a Ray task/actor: the physical NPU ids Ray assigned to it (empty outside Ray)."""
    import ray  # lazy: the other placement helpers need no Ray

    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get(NPU_RESOURCE, [])]


def k8s_resources(npus: int, resource: str = K8S_NPU_RESOURCE) -> dict[str, dict[str, str]]:
    """Container ``resources`` for a pod with ``npus`` Ascend chips (the device plugin needs
    equal requests and limits); empty for 0."""
    n = _count(npus)
    if not n:
        return {}
    return {"requests": {resource: str(n)}, "limits": {resource: str(n)}}


def ray_start_params(npus: int) -> dict[str, str]:
    """KubeRay ``rayStartParams`` advertising the pod's NPUs to Ray as ``{"NPU": n}``."""
    n = _count(npus)
    if not n:
        return {}
    return {"resources": json.dumps(json.dumps({NPU_RESOURCE: n}))}


def peer_options(npus: int, threads: int, placement: PeerPlacement | None = None) -> Any:
    """Ray options of a role's peer ranks: ``threads`` CPUs and ``npus`` NPUs each, in their bundles of
    the job's placement group when there is one (then a function of the rank)."""
    base = actor_options(npus, threads)
    return placement.options(base) if placement is not None else base


# ---- the placement group of a job ------------------------------------------------------------------

#: ``parallel.placement`` -> Ray's placement-group strategy.
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK"}
#: How long a job waits for the cluster to reserve all of its ranks before it fails.
PLACEMENT_TIMEOUT_S = 120.0


class PlacementError(RuntimeError):
    """The cluster cannot place every rank of the job (it never starts partly placed)."""


def role_worlds(spec: Any) -> dict[str, int]:
    """Ranks of each role of ``spec`` (a ``JobSpec``): its service (rank 0) and its peer ranks."""
    import math

    r, t = spec.parallel.rollout, spec.parallel.trainer
    return {"rollout": math.lcm(r.tp, r.ep) if spec.rollout.engine == "onpolicy" else 1,
            "trainer": t.dp if t.dp > 1 else math.lcm(t.tp, t.ep), "verifier": 1}


def rank_resources(cpus: float, npus: int, rank: int) -> dict[str, float]:
    """One rank's bundle: rank 0 (the role's service) asks for the role's ``cpus``; a peer rank for as
    many CPUs as the threads it runs with (the service's, at least 1)."""
    bundle = {"CPU": max(float(cpus), 0.01) if rank == 0 else float(max(1, int(cpus)))}  # a bundle is never empty
    if npus:
        bundle[NPU_RESOURCE] = float(npus)
    return bundle


def in_bundle(group: Any, index: int) -> dict[str, Any]:
    """Ray options scheduling an actor into bundle ``index`` of placement group ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


@dataclass(frozen=True)
class PeerPlacement:
    """Where a role's peer ranks go: bundles ``bundles[r - 1]`` of placement group ``group`` for rank r."""

    group: Any
    bundles: tuple[int, ...]

    def options(self, base: Mapping[str, Any]) -> Callable[[int], dict[str, Any]]:
        """Per-rank Ray options: ``base`` (CPUs, NPUs) scheduled into the rank's bundle."""
        return lambda rank: {**base, **in_bundle(self.group, self.bundles[rank - 1])}


@dataclass(frozen=True)
class JobPlacement:
    """A job's placement group: one bundle per rank of every role, reserved all together."""

    group: Any
    first: Mapping[str, int]
    """Bundle index of each role's rank 0; its peers' bundles follow it."""
    worlds: Mapping[str, int]

    def for_service(self, role: str) -> dict[str, Any]:
        """Ray options scheduling ``role``'s service into its rank-0 bundle."""
        return in_bundle(self.group, self.first[role])

    def peers(self, role: str) -> PeerPlacement | None:
        if self.worlds[role] == 1:
            return None
        first = self.first[role]
        return PeerPlacement(self.group, tuple(range(first + 1, first + self.worlds[role])))

    def nodes(self) -> dict[str, list[str]]:
        """Node id -> the ranks placed there (``role`` or ``role rank r``)."""
        from ray.util import placement_group_table

        where = placement_group_table(self.group).get("bundles_to_node_id", {})
        out: dict[str, list[str]] = {}
        for role, first in self.first.items():
            for r in range(self.worlds[role]):
                node = where.get(first + r)
                if node:
                    out.setdefault(node, []).append(role if r == 0 else f"{role} rank {r}")
        return out

    def remove(self) -> None:
        from ray.util import remove_placement_group

        remove_placement_group(self.group)


def reserve(spec: Any, job_id: str, timeout_s: float = PLACEMENT_TIMEOUT_S) -> JobPlacement:
    """Reserve every rank of ``spec``'s job in one placement group (``parallel.placement``'s strategy),
    or raise ``PlacementError`` naming what the job asks for: when the cluster never has room for all
    of it within ``timeout_s`` (nothing stays reserved)."""
    import ray
    from ray.util import placement_group, remove_placement_group

    worlds = role_worlds(spec)
    bundles: list[dict[str, float]] = []
    first: dict[str, int] = {}
    for role, world in worlds.items():
        res = spec.resources_for(role)
        first[role] = len(bundles)
        bundles += [rank_resources(res.cpus, res.npus, r) for r in range(world)]
    strategy = STRATEGIES[spec.parallel.placement]
    group = placement_group(bundles, strategy=strategy, name=f"onpolicy-{job_id}")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        need = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", NPU_RESOURCE)}
        raise PlacementError(
            f"the cluster cannot place the job's {len(bundles)} ranks ({strategy}: {need['CPU']:g} CPUs"
            + (f", {need[NPU_RESOURCE]:g} NPUs" if need[NPU_RESOURCE] else "")
            + f") within {timeout_s:.0f} s; its resources: {ray.cluster_resources()}")
    return JobPlacement(group, first, worlds)
