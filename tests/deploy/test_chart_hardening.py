"""The chart's hardening, rendered by Helm's own engine (helm-python-sdk, offline): values checked
against values.schema.json (lint and install refuse bad values), a restricted container
securityContext on every container with emptyDirs for the writable paths, the optional
NetworkPolicy and Ray PodMonitor (schema-valid, selecting exactly the pods they mean), and a
non-root ``USER`` in the NPU image."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from chart_tools import CHART, NAMESPACE, ROOT, Rendered, validate, values_of

PROFILES = {"default": (), "cpu": ("values-cpu.yaml",), "npu": ("values-npu.yaml",)}
RAY_PODS = ("ray-head", "rollout", "trainer", "verifier")


def pod_templates(r: Rendered) -> dict[str, dict[str, Any]]:
    """Each pod template (metadata + spec): the Ray head, each worker group, the controller."""
    rc = r.one("RayCluster")
    pods = {"ray-head": rc["spec"]["headGroupSpec"]["template"]}
    for g in rc["spec"]["workerGroupSpecs"]:
        pods[g["groupName"]] = g["template"]
    pods["controller"] = r.one("Deployment", "-controller")["spec"]["template"]
    return pods


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists) applied to ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, key, values = e["operator"], e["key"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def test_values_are_checked_against_the_schema(render) -> None:
    import helm_python

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False and {"securityContext", "networkPolicy"} <= set(schema["properties"])
    for files in PROFILES.values():  # every shipped profile, every toggle on, passes
        on = {"networkPolicy.enabled": True, "metrics.rayPodMonitor.enabled": True,
              "metrics.serviceMonitor.enabled": True, "metrics.prometheusRule.enabled": True}
        report = helm_python.lint(str(CHART), values_of(*files, **on), strict=True, namespace=NAMESPACE)
        assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    bad = {"controler": {"port": 1}, "controller.port": "50051", "storage.accessModes": ["ReadWriteAll"],
           "metrics.rayPodMonitor.interval": "often", "networkPolicy.enabled": "yes"}
    for key, value in bad.items():
        report = helm_python.lint(str(CHART), values_of(**{key: value}), strict=True, namespace=NAMESPACE)
        assert report["errors"], key
        with pytest.raises(helm_python.HelmError, match="schema"):
            render(**{key: value})


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_container_runs_restricted_with_writable_emptydirs(render, profile: str) -> None:
    r = render(*PROFILES[profile])
    values = values_of(*PROFILES[profile])
    for name, tpl in pod_templates(r).items():
        spec = tpl["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault"
            assert "privileged" not in sc
        main = spec["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in main["env"]}
        writable = ["/tmp", values["onpolicyHome"]] + (["/dev/shm"] if name in RAY_PODS else [])
        for path in writable:  # Ray's session dir, HOME, $ONPOLICY_HOME, the object store
            assert "emptyDir" in volumes[mounts[path]], (name, path)
        assert env["HOME"] == "/tmp" and env["ONPOLICY_HOME"] == values["onpolicyHome"]
        assert mounts[values["storage"]["mountPath"]] == "data"
        groups = spec.get("securityContext", {}).get("supplementalGroups")
        npus = values["ray"]["workers"].get(name, {}).get("npus", 0)
        assert groups == (values["npu"]["deviceGroups"] if npus else None), (name, groups)
        validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


def test_the_network_policy_admits_only_the_release_and_the_listed_peers(render) -> None:
    assert not render().of("NetworkPolicy")
    users = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml-users"}}}]
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    r = render(**{"networkPolicy.enabled": True, "networkPolicy.jobServiceFrom": users,
                  "networkPolicy.metricsFrom": monitoring})
    policy = r.one("NetworkPolicy")
    validate(policy)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    pods = pod_templates(r)
    assert all(selects(spec["podSelector"], tpl["metadata"]["labels"]) for tpl in pods.values())
    own, jobs, metrics = spec["ingress"]
    assert "ports" not in own and len(own["from"]) == 1
    assert all(selects(own["from"][0]["podSelector"], tpl["metadata"]["labels"]) for tpl in pods.values())
    assert not selects(own["from"][0]["podSelector"], {"app.kubernetes.io/name": "other"})
    values = values_of()
    assert jobs == {"from": users, "ports": [{"protocol": "TCP", "port": values["controller"]["port"]}]}
    assert metrics["from"] == monitoring
    assert {p["port"] for p in metrics["ports"]} == {values["controller"]["metricsPort"], 8080}
    for rule in spec["ingress"]:  # no rule admits everyone
        assert rule.get("from"), rule
    only_own = render(**{"networkPolicy.enabled": True}).one("NetworkPolicy")["spec"]["ingress"]
    assert len(only_own) == 1


def test_the_ray_pod_monitor_scrapes_every_ray_pod_and_only_those(render) -> None:
    assert not render().of("PodMonitor")
    r = render(**{"metrics.rayPodMonitor.enabled": True, "metrics.rayPodMonitor.labels": {"release": "kps"}})
    monitor = r.one("PodMonitor")
    validate(monitor)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for name, tpl in pod_templates(r).items():
        picked = selects(monitor["spec"]["selector"], tpl["metadata"]["labels"])
        assert picked == (name in RAY_PODS), name
        if picked:
            ports = {p["name"]: p["containerPort"] for p in tpl["spec"]["containers"][0].get("ports", [])}
            assert ports.get("metrics") == 8080, name
    bad = dict(monitor)
    bad["spec"] = {**monitor["spec"], "podMetricEndpoints": []}  # a typo the CRD schema must refuse
    with pytest.raises(AssertionError):
        validate(bad)


def test_the_npu_image_runs_as_a_non_root_user_in_the_device_group() -> None:
    text = (ROOT / "deploy" / "Dockerfile.npu").read_text()
    users = re.findall(r"^USER\s+(\S+)\s*$", text, flags=re.M)
    assert users == ["1000"], users
    after = text[text.index("USER 1000"):]
    assert not re.search(r"^RUN\b", after, flags=re.M)  # every build step ran before the switch
    assert "HWHIAIUSER_GID" in text and re.search(r"usermod -a -G .*HWHIAIUSER_GID", text)
    assert 'chown 1000:0 "${ONPOLICY_HOME}"' in text
    values = values_of("values-npu.yaml")
    default_gid = re.search(r"^ARG HWHIAIUSER_GID=(\d+)$", text, flags=re.M).group(1)
    assert values["npu"]["deviceGroups"] == [int(default_gid)]
