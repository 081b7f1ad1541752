"""helm/onpolicy rendered by Helm's own engine (helm-python-sdk, offline) for the default, CPU and
NPU profiles, every object validated against the Kubernetes / CRD schemas, and the specifics the
deployment relies on checked on the rendered objects."""

from __future__ import annotations

import base64
import json
import re
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
import yaml
from chart_tools import CHART, NAMESPACE, RELEASE, ROOT, Rendered, validate, values_of

from onpolicy.services.cluster.placement import K8S_NPU_RESOURCE, NPU_RESOURCE, k8s_resources, ray_start_params

PROFILES = {"default": (), "cpu": ("values-cpu.yaml",), "npu": ("values-npu.yaml",)}
ALL_ON = {"metrics.serviceMonitor.enabled": True, "metrics.prometheusRule.enabled": True}
WORKER_GROUPS = ("rollout", "trainer", "verifier")
FULL = f"{RELEASE}-onpolicy"


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def worker_groups(r: Rendered) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}


def controller(r: Rendered) -> dict[str, Any]:
    return r.one("Deployment", "-controller")["spec"]["template"]["spec"]["containers"][0]


# ---- rendering and schema validation ---------------------------------------------------------------

@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("toggles", ["plain", "monitoring", "tls"])
def test_every_rendered_object_is_schema_valid(render, profile: str, toggles: str) -> None:
    extra: dict[str, Any] = {}
    if toggles == "monitoring":
        extra = ALL_ON
    elif toggles == "tls":
        extra = {"tls.enabled": True, "tls.secretName": "onpolicy-tls", "tls.clientCA.secretName": "onpolicy-ca",
                 "auth.existingSecret": "my-token", "storage.existingClaim": "shared"}
    r = render(*PROFILES[profile], **extra)
    kinds = sorted(o["kind"] for o in r.objects)
    expected = {"ConfigMap", "Deployment", "RayCluster", "Service"}
    assert expected <= set(kinds), kinds
    if toggles == "monitoring":
        assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds)
    for obj in r.objects:
        assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        validate(obj)


def test_the_validators_reject_what_they_should(render) -> None:
    """A validator that accepts anything proves nothing: typos, wrong types, unknown kinds fail."""
    import kubernetes_validate

    r = render(**ALL_ON)
    deployment = r.one("Deployment", "-controller")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    rc = r.one("RayCluster")
    rc["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 4  # must be a string
    with pytest.raises(AssertionError, match="rayStartParams"):
        validate(rc)
    rule = r.one("PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["exprr"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    with pytest.raises(AssertionError):
        validate(rule)
    with pytest.raises(AssertionError, match="no schema"):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_helm_lint_is_clean() -> None:
    import helm_python

    for files in PROFILES.values():
        report = helm_python.lint(str(CHART), values_of(*files, **ALL_ON), strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


def test_template_errors_are_explained(render) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match=r"tls\.secretName"):
        render(**{"tls.enabled": True})
    with pytest.raises(helm_python.HelmError, match="extraRayResources"):
        render(**{"ray.workers.rollout.rayStartParams": {"resources": '"{\\"x\\": 1}"'}})


# ---- NPUs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["default", "npu"])
def test_npu_groups_request_ascend_chips_and_advertise_them_to_ray(render, profile: str) -> None:
    r = render(*PROFILES[profile])
    values = values_of(*PROFILES[profile])
    groups = worker_groups(r)
    assert set(groups) == set(WORKER_GROUPS)
    for name, group in groups.items():
        n = values["ray"]["workers"][name]["npus"]
        assert n > 0
        container = containers(group["template"]["spec"])[0]
        # the device plugin's resource, equal requests and limits (what placement.k8s_resources says)
        res = container["resources"]
        want = k8s_resources(n)
        assert res["requests"][K8S_NPU_RESOURCE] == want["requests"][K8S_NPU_RESOURCE] == str(n)
        assert res["limits"][K8S_NPU_RESOURCE] == want["limits"][K8S_NPU_RESOURCE]
        # rayStartParams: a JSON string quoted once more, as KubeRay pastes it after --resources=
        value = group["rayStartParams"]["resources"]
        assert json.loads(json.loads(value)) == {NPU_RESOURCE: n}
        assert json.loads(json.loads(value)) == json.loads(json.loads(ray_start_params(n)["resources"]))
        # what bash makes of `ray start --resources=<value>` (KubeRay's command line) is Ray's JSON
        assert shlex.split(f"--resources={value}") == [f"--resources={json.loads(value)}"]
        assert "npu" in container["image"]
    head = r.one("RayCluster")["spec"]["headGroupSpec"]
    assert "resources" not in head["rayStartParams"] and head["rayStartParams"]["num-cpus"] == "0"
    assert K8S_NPU_RESOURCE not in json.dumps(head["template"])


def test_the_npu_profile_mounts_the_driver_and_selects_ascend_nodes(render) -> None:
    r = render("values-npu.yaml")
    for name, group in worker_groups(r).items():
        pod = group["template"]["spec"]
        host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        assert "/usr/local/Ascend/driver" in host_paths, name
        mounts = {m["mountPath"]: m for m in containers(pod)[0]["volumeMounts"]}
        assert all(mounts[p].get("readOnly") for p in host_paths)
        assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert "hostPath" not in json.dumps(r.pod_specs()["controller"])


def test_cpu_profile_has_no_npu_anywhere(render) -> None:
    r = render("values-cpu.yaml", **ALL_ON)
    text = json.dumps(r.objects)
    assert "Ascend910" not in text and "hostPath" not in text
    for name, group in worker_groups(r).items():
        assert "resources" not in group["rayStartParams"], name
        container = containers(group["template"]["spec"])[0]
        assert not any("huawei.com" in k for k in container["resources"].get("requests", {}))
        assert "npu" not in container["image"]


def test_npu_resource_name_and_extra_ray_resources_are_configurable(render) -> None:
    r = render(**{"npu.resourceName": "huawei.com/Ascend310P", "ray.workers.verifier.extraRayResources": {"v": 1}})
    groups = worker_groups(r)
    res = containers(groups["rollout"]["template"]["spec"])[0]["resources"]
    assert res["limits"]["huawei.com/Ascend310P"] == "8" and K8S_NPU_RESOURCE not in res["limits"]
    assert json.loads(json.loads(groups["verifier"]["rayStartParams"]["resources"])) == {"NPU": 4, "v": 1}


def test_disabled_worker_group_is_left_out(render) -> None:
    r = render(**{"ray.workers.verifier.enabled": False})
    assert set(worker_groups(r)) == {"rollout", "trainer"}


# ---- the job controller ------------------------------------------------------------------------------

def test_controller_runs_onpolicy_up_against_the_kuberay_head(render) -> None:
    from onpolicy.cli.main import build_parser

    r = render()
    c = controller(r)
    head_svc = f"{r.one('RayCluster')['metadata']['name']}-head-svc"
    argv = c["command"][1:] + c["args"]
    assert c["command"] == ["onpolicy"] and argv[0] == "up"
    args = build_parser().parse_args(argv)  # every flag exists in the CLI the image runs
    assert (args.host, args.port, args.metrics_port, args.metrics_host) == ("0.0.0.0", 50051, 9400, "0.0.0.0")
    # Ray Client: the controller pod runs no raylet, so a GCS address (<head>:6379) cannot work there
    assert args.ray_address == f"ray://{head_svc}.{NAMESPACE}.svc:10001"
    assert args.token_file == "/etc/onpolicy/token/token"
    assert args.state_dir == "/mnt/onpolicy/controller"
    assert args.tls_cert is None
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9400}
    deployment = r.one("Deployment", "-controller")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    wait = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert wait["command"][-1] == args.ray_address
    assert args.allow_reward_modules == ""  # only the registered rewards unless the operator allows more
    assert args.data_root == [] and args.model_root == []
    c = controller(render(**{"controller.allowRewardModules": ["mypkg", "other"],
                             "controller.dataRoots": ["/mnt/onpolicy/data", "/data"],
                             "controller.modelRoots": ["/mnt/onpolicy/models"]}))
    args = build_parser().parse_args(c["command"][1:] + c["args"])
    assert args.allow_reward_modules == "mypkg,other" and args.data_root == ["/mnt/onpolicy/data", "/data"]
    assert args.model_root == ["/mnt/onpolicy/models"]


def test_controller_has_native_grpc_probes_on_the_grpc_port(render) -> None:
    c = controller(render())
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 50051}, probe
    svc = render().one("Service", "-controller")
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP",
                                     "appProtocol": "grpc"}]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "controller"


def test_tls_mounts_the_certificates_and_probes_over_tcp(render) -> None:
    from onpolicy.cli.main import build_parser

    r = render(**{"tls.enabled": True, "tls.secretName": "onpolicy-tls", "tls.clientCA.secretName": "onpolicy-ca"})
    c = controller(r)
    args = build_parser().parse_args(c["args"])
    assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
        "/etc/onpolicy/tls/tls.crt", "/etc/onpolicy/tls/tls.key", "/etc/onpolicy/client-ca/ca.crt")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):  # kubelet's gRPC probe has no TLS
        assert "grpc" not in c[probe] and c[probe]["tcpSocket"] == {"port": "grpc"}
    volumes = {v["name"]: v for v in r.pod_specs()["controller"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "onpolicy-tls"
    assert volumes["client-ca"]["secret"]["secretName"] == "onpolicy-ca"
    assert "--tls-ca ca.crt" in r.notes


def test_role_tls_is_mounted_on_every_pod_at_the_path_the_controller_names(render) -> None:
    from onpolicy.cli.main import build_parser

    plain = render()
    assert build_parser().parse_args(controller(plain)["args"]).role_tls_cert is None
    assert all("role-tls" not in {v["name"] for v in pod.get("volumes", [])} for pod in plain.pod_specs().values())
    r = render(**{"roleTls.secretName": "onpolicy-roles", "roleTls.name": "roles.onpolicy"})
    args = build_parser().parse_args(controller(r)["args"])
    assert (args.role_tls_cert, args.role_tls_key, args.role_tls_ca, args.role_tls_name) == (
        "/etc/onpolicy/role-tls/tls.crt", "/etc/onpolicy/role-tls/tls.key", "/etc/onpolicy/role-tls/ca.crt",
        "roles.onpolicy")
    pods = r.pod_specs()
    assert set(pods) >= {"ray-head", "controller"} and len(pods) >= 4  # head, the worker groups, the controller
    for name, pod in pods.items():  # the roles run on Ray pods and read the files the controller names
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["role-tls"]["secret"]["secretName"] == "onpolicy-roles", name
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == "role-tls"]
        assert mounts == [{"name": "role-tls", "mountPath": "/etc/onpolicy/role-tls", "readOnly": True}], name


# ---- secrets -----------------------------------------------------------------------------------------

def test_auth_token_secret_is_generated_and_mounted_as_the_token_file(render) -> None:
    r = render()
    secrets = {s["metadata"]["name"]: s for s in r.of("Secret")}
    token = base64.b64decode(secrets[f"{FULL}-auth"]["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    assert secrets[f"{FULL}-auth"]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in r.pod_specs()["controller"]["volumes"]}
    assert volumes["token"]["secret"] == {"secretName": f"{FULL}-auth", "items": [{"key": "token", "path": "token"}]}
    mounts = {m["name"]: m for m in controller(r)["volumeMounts"]}
    assert mounts["token"]["mountPath"] == "/etc/onpolicy/token" and mounts["token"]["readOnly"]
    # an existing Secret replaces the generated one
    r = render(**{"auth.existingSecret": "mine", "auth.secretKey": "bearer"})
    assert f"{FULL}-auth" not in {s["metadata"]["name"] for s in r.of("Secret")}
    volumes = {v["name"]: v for v in r.pod_specs()["controller"]["volumes"]}
    assert volumes["token"]["secret"] == {"secretName": "mine", "items": [{"key": "bearer", "path": "token"}]}


def test_every_ray_container_and_the_controller_share_the_ray_auth_token(render) -> None:
    r = render()
    ray_secret = r.one("Secret", "-ray-auth")
    assert set(ray_secret["data"]) == {"auth_token"}
    for name, pod in r.pod_specs().items():
        env = env_of(containers(pod)[0])
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": f"{FULL}-ray-auth", "key": "auth_token"}}, name
    r = render(**{"ray.auth.enabled": False})
    assert not [s for s in r.of("Secret") if s["metadata"]["name"].endswith("-ray-auth")]
    assert all(env_of(containers(p)[0])["RAY_AUTH_MODE"] == "disabled" for p in r.pod_specs().values())


class _FakeKubeAPI(BaseHTTPRequestHandler):
    """Just enough of the Kubernetes API for Helm's ``lookup`` of Secrets: discovery and GET."""

    secrets: ClassVar[dict[str, dict[str, str]]] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?")[0].strip("/").split("/")
        if path == ["api"]:
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == ["apis"]:
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
        if path == ["api", "v1"]:
            return self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                 "verbs": ["get", "list"]}]})
        if len(path) == 6 and path[:3] == ["api", "v1", "namespaces"] and path[4] == "secrets" \
                and path[5] in self.secrets:
            return self._send(200, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                    "metadata": {"name": path[5], "namespace": path[3]}, "data": self.secrets[path[5]]})
        return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                "code": 404})


def test_generated_token_survives_helm_upgrade_via_lookup() -> None:
    """`helm upgrade` renders against the live cluster: ``lookup`` finds the Secret and the chart
    keeps its token (a new random one would lock every client out). A fake API server answers
    Helm's discovery and GET; the real Helm engine does the rest."""
    import helm_python

    kept = base64.b64encode(b"the-token-clients-already-have").decode()
    _FakeKubeAPI.secrets = {f"{FULL}-auth": {"token": kept}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeKubeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = helm_python.Config(kube_apiserver=f"http://127.0.0.1:{server.server_address[1]}", kube_token="t",
                                 namespace=NAMESPACE)
        out = cfg.render(helm_python.Chart.load(str(CHART)), {}, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    finally:
        server.shutdown()
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out["onpolicy/templates/secret-auth.yaml"]) if d}
    assert secrets[f"{FULL}-auth"]["data"]["token"] == kept
    # the Ray token did not exist yet: generated
    ray_token = base64.b64decode(secrets[f"{FULL}-ray-auth"]["data"]["auth_token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", ray_token)


# ---- storage -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_one_volume_is_mounted_by_every_pod_at_the_same_path(render, profile: str) -> None:
    r = render(*PROFILES[profile])
    values = values_of(*PROFILES[profile])
    pvc = r.one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == values["storage"]["accessModes"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pods = r.pod_specs()
    assert set(pods) == {"ray-head", "controller", *WORKER_GROUPS}
    for name, pod in pods.items():
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert list(claims.values()) == [pvc["metadata"]["name"]], name
        (volume,) = claims
        mounts = [m["mountPath"] for m in containers(pod)[0]["volumeMounts"] if m["name"] == volume]
        assert mounts == ["/mnt/onpolicy"], name
    # the controller keeps its state (and jobs' weight versions and checkpoints) on that volume
    assert controller(r)["args"][controller(r)["args"].index("--state-dir") + 1].startswith("/mnt/onpolicy/")


def test_existing_claim_and_storage_class(render) -> None:
    r = render(**{"storage.existingClaim": "team-nfs"})
    assert not r.of("PersistentVolumeClaim")
    for pod in r.pod_specs().values():
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "team-nfs"}} in pod["volumes"]
    assert render(**{"storage.storageClass": "cephfs"}).one("PersistentVolumeClaim")["spec"]["storageClassName"] \
        == "cephfs"
    assert render(**{"storage.storageClass": "-"}).one("PersistentVolumeClaim")["spec"]["storageClassName"] == ""
    assert "storageClassName" not in render().one("PersistentVolumeClaim")["spec"]


# ---- metrics, monitoring, dashboard ------------------------------------------------------------------

def test_metrics_service_targets_the_controller_metrics_port(render) -> None:
    r = render(**ALL_ON)
    svc = r.one("Service", "-metrics")
    assert svc["spec"]["ports"][0]["name"] == "metrics" and svc["spec"]["ports"][0]["targetPort"] == "metrics"
    pod_labels = r.one("Deployment", "-controller")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    sm = r.one("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # keep our `job` label (the job id)
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_monitoring_objects_follow_their_toggles(render) -> None:
    kinds = {o["kind"] for o in render().objects}
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds and "ConfigMap" in kinds
    r = render(**{"grafana.dashboard.enabled": False, "metrics.service.enabled": False})
    assert not r.of("ConfigMap") and not [s for s in r.of("Service") if s["metadata"]["name"].endswith("-metrics")]
    labels = {"release": "kube-prometheus-stack"}
    r = render(**ALL_ON, **{"metrics.serviceMonitor.labels": labels, "metrics.prometheusRule.labels": labels})
    assert r.one("ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert r.one("PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_embeds_deploy_rules(render) -> None:
    rule = render(**ALL_ON).one("PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy/prometheus/rules.yaml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert exprs["OnpolicyLogdiffNonZero"].strip() == "max by (job, model) (onpolicy_logdiff_max) > 0"


def test_grafana_dashboard_configmap(render) -> None:
    r = render(**{"grafana.dashboard.namespace": "monitoring"})
    cm = r.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["onpolicy.json"]) == json.loads((ROOT / "deploy/grafana/onpolicy.json").read_text())


@pytest.mark.parametrize("name", ["grafana/onpolicy.json", "prometheus/rules.yaml"])
def test_deploy_links_to_the_one_source_in_the_chart(name: str) -> None:
    """Helm reads only files inside the chart, so the dashboard and the rules live there, once;
    deploy/ links to them (one file, nothing to keep in sync)."""
    link = ROOT / "deploy" / name
    assert link.is_symlink() and link.resolve() == (CHART / "files" / name).resolve()
    assert not (CHART / "files" / name).is_symlink()


# ---- NOTES ------------------------------------------------------------------------------------------

def test_notes_tell_how_to_submit_a_job_and_find_the_dashboard(render) -> None:
    from onpolicy.cli.main import build_parser

    r = render(**ALL_ON)
    assert f"port-forward svc/{FULL}-controller 50051:50051" in r.notes
    assert f"get secret {FULL}-auth" in r.notes
    commands = [line.strip() for line in r.notes.splitlines()
                if re.match(r"onpolicy (submit|jobs|watch|cancel) ", line.strip())]
    assert len(commands) >= 2
    assert any(c.startswith("onpolicy submit job.yaml --address 127.0.0.1:50051 --token-file") for c in commands)
    for c in commands:  # every command the notes print parses with the real CLI
        build_parser().parse_args(shlex.split(c)[1:])
    assert "/d/onpolicy-consistency" in r.notes and f"ConfigMap/{FULL}-dashboard" in r.notes


def test_names_stay_within_kubernetes_limits(render) -> None:
    long = "a-very-long-release-name-that-goes-on-and-on-and-on"
    r = render(**{"fullnameOverride": long})
    rc = r.one("RayCluster")["metadata"]["name"]
    assert len(f"{rc}-head-svc") <= 63
    for obj in r.objects:
        assert len(obj["metadata"]["name"]) <= 63
        validate(obj)
