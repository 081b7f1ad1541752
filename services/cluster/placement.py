"""Placement of role services and their peer ranks: Ray resources (CPUs, Ascend NPUs), device
visibility, Kubernetes requests.

Ray (>= 2.10) knows Ascend NPUs as the accelerator resource ``NPU`` and sets
``ASCEND_RT_VISIBLE_DEVICES`` for every task or actor that requests it, so inside an actor the
assigned NPUs are ``npu:0 .. npu:n-1``. On Kubernetes the Ascend device plugin exposes
``huawei.com/Ascend910`` and KubeRay passes ``{"NPU": n}`` to ``ray start``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

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
