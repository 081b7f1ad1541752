"""Rendering helm/onpolicy with Helm's own engine and validating what it renders, offline.

* ``render(*value_files, **overrides)``: ``helm install --dry-run=client`` through helm-python-sdk
  (the Helm SDK compiled into a shared library: the same template engine, Sprig functions,
  ``.Files`` and ``lookup`` as the ``helm`` binary, without a cluster). Returns the manifest's
  objects and the rendered NOTES.
* ``validate(obj)``: core kinds against the Kubernetes OpenAPI schemas bundled with
  kubernetes-validate (strict: unknown fields fail) for the oldest and newest Kubernetes the chart
  claims; the custom resources (RayCluster, ServiceMonitor, PrometheusRule, PodMonitor) against the
  JSON schemas made from their CRDs, copied into tests/deploy/schemas/. Any other kind is a failure.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "onpolicy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE, NAMESPACE = "op", "onpolicy"
# chart.yaml kubeVersion ">=1.27.0-0" (native gRPC probes are GA from 1.27) .. newest bundled schemas
KUBE_VERSIONS = ("1.27", "1.37")
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster-ray-v1.json.gz",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json.gz",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json.gz",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json.gz",
}


def need(module: str, why: str) -> Any:
    """Import ``module`` (a tool of the ``test`` extra); skip without it, except in CI (``$CI`` set)."""
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is missing ({why}): CI installs the `test` extra")
        pytest.skip(f"{module} is not installed ({why}; pip install -e '.[test]')")


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def dotted(overrides: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}`` (like ``helm --set``, values keep their types)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


@dataclass
class Rendered:
    objects: list[dict[str, Any]]
    notes: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.of(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
        return found[0]

    def pod_specs(self) -> dict[str, dict[str, Any]]:
        """Every pod template: the Ray head, each worker group and the controller."""
        rc = self.one("RayCluster")
        pods = {"ray-head": rc["spec"]["headGroupSpec"]["template"]["spec"]}
        for g in rc["spec"].get("workerGroupSpecs", []):
            pods[g["groupName"]] = g["template"]["spec"]
        pods["controller"] = self.one("Deployment", "-controller")["spec"]["template"]["spec"]
        return pods


def _render(values_json: str) -> Rendered:
    import helm_python

    cfg = helm_python.Config(namespace=NAMESPACE, storage_driver="memory")
    release = cfg.install(str(CHART), RELEASE, json.loads(values_json), dry_run="client")
    objects = [d for d in yaml.safe_load_all(release["manifest"]) if d]
    return Rendered(objects, release.get("notes") or "")


@functools.lru_cache(maxsize=64)
def render_cached(values_json: str) -> Rendered:
    return _render(values_json)


def values_of(*files: str, **overrides: Any) -> dict[str, Any]:
    """The chart's values.yaml, then each profile file, then ``overrides`` (dotted keys)."""
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in files:
        values = deep_merge(values, yaml.safe_load((CHART / f).read_text()) or {})
    return deep_merge(values, dotted({k.replace("__", "."): v for k, v in overrides.items()}))


@functools.cache
def crd_validator(api_version: str, kind: str) -> Any:
    import jsonschema

    schema = json.loads(gzip.decompress((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_bytes()))
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise (AssertionError or kubernetes_validate.ValidationError) unless ``obj`` is valid."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        errors = sorted(crd_validator(*key).iter_errors(obj), key=lambda e: list(e.absolute_path))
        assert not errors, f"{key[1]} {obj['metadata'].get('name')}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5])
        return
    kubernetes_validate = need("kubernetes_validate", "validates core objects against the Kubernetes schemas")
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as e:  # an unknown kind is a failure, not a pass
            raise AssertionError(f"no schema for {key} in Kubernetes {version}: {e}") from None
