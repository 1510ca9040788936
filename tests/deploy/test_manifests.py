"""The kustomize manifests: rendered with ``kubectl kustomize``, validated strictly (unknown
fields are errors) with kubernetes-validate, and the CRD kinds with jsonschema against the CRD
schemas in tests/deploy/crds/."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .manifests import by_kind, by_name, container, render
from .tools import ROOT

#: The oldest and the newest Kubernetes supported (docs/kubernetes.md).
K8S_VERSIONS = ["1.34.0", "1.37.0"]
CRDS = Path(__file__).parent / "crds"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors.yaml",
             ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules.yaml",
             ("security.openshift.io/v1", "SecurityContextConstraints"):
                 "securitycontextconstraints.yaml"}
TREES = ["daemonset", "daemonset/base", "daemonset/overlays/openshift",
         "daemonset/overlays/mig-manager"]
EXAMPLES = ROOT / "daemonset" / "examples"


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as a JSON schema: nullable becomes a null type, and objects with
    listed properties allow no others (unknown fields are errors)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / name).read_text())
    (version,) = crd["spec"]["versions"]
    return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def examples() -> list[dict[str, Any]]:
    """The worked examples of docs/kubernetes.md, every document of daemonset/examples/."""
    return [doc for path in sorted(EXAMPLES.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("tree", TREES)
def test_every_manifest_validates(tree: str, version: str) -> None:
    """Every rendered object is valid, unknown fields included, on the oldest and the newest
    Kubernetes supported."""
    docs = render(tree)
    assert docs
    for doc in docs:
        crd = CRD_KINDS.get((doc["apiVersion"], doc["kind"]))
        if crd is not None:
            jsonschema.validate(doc, crd_schema(crd))
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def claim_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The ResourceClaim spec of an example's ResourceClaimTemplate or ResourceClaim."""
    spec: dict[str, Any] = doc["spec"]["spec"] if doc["kind"] == "ResourceClaimTemplate" \
        else doc["spec"]
    return spec


def pod_claim(entry: dict[str, Any]) -> tuple[str, str]:
    """(kind, name) of the template or the claim a pod's resourceClaims entry names."""
    if "resourceClaimTemplateName" in entry:
        return "ResourceClaimTemplate", entry["resourceClaimTemplateName"]
    return "ResourceClaim", entry["resourceClaimName"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_examples_validate_and_name_shipped_classes(version: str) -> None:
    """The worked examples are valid objects, ask only for DeviceClasses the manifests ship,
    and each pod uses only claims (templates or claims it shares) that its examples define."""
    docs = examples()
    assert {d["kind"] for d in docs} == {"ResourceClaimTemplate", "ResourceClaim", "Pod", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    shipped = {d["metadata"]["name"] for d in render("daemonset") if d["kind"] == "DeviceClass"}
    specs = {(d["kind"], d["metadata"]["name"]): claim_spec(d) for d in docs
             if d["kind"] in ("ResourceClaimTemplate", "ResourceClaim")}
    asked = {r["exactly"]["deviceClassName"] for spec in specs.values()
             for r in spec["devices"]["requests"]}
    assert asked == shipped
    # A Job's pods (the compute-domain example) are its template's.
    pods = [d for d in docs if d["kind"] == "Pod"] + [d["spec"]["template"] for d in docs
                                                      if d["kind"] == "Job"]
    for pod in pods:
        claims = {c["name"]: pod_claim(c) for c in pod["spec"]["resourceClaims"]}
        assert set(claims.values()) <= set(specs)
        used = {c["name"] for ct in pod["spec"]["containers"] for c in ct["resources"]["claims"]}
        assert used == set(claims)


def test_crd_schemas_catch_unknown_fields() -> None:
    monitor = copy.deepcopy(by_kind(render("daemonset/base"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="scrapeInterval"):
        jsonschema.validate(monitor, crd_schema("servicemonitors.yaml"))


def test_daemonset_shape() -> None:
    docs = render("daemonset")
    ds = by_name(docs, "DaemonSet", "gpu-node-agent")
    pod = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["agent", "kubelet-plugin"]
    agent = container(pod, "agent")
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["priorityClassName"] == "system-node-critical"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert agent[probe]["httpGet"] == {"path": path, "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in agent["ports"]
    args = agent["args"]
    assert "--metrics-listen=0.0.0.0:9400" in args
    assert "--listen=$(POD_IP):9401" in args  # the API on the pod IP only ...
    assert {a.split("=")[0] for a in args} >= {"--tls-cert", "--tls-key", "--token-file",
                                               "--driver-root"}  # ... with TLS and a token
    assert "--listen=unix:/run/gpu-agent/agent.sock" in args
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent["securityContext"]["privileged"] is True
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths >= {"/var/run/cdi", "/var/lib/gpu-agent", "/run/gpu-agent", "/dev"}
    secrets = {v["secret"]["secretName"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets["gpu-node-agent-tokens"]["defaultMode"] == 0o400
    assert agent["resources"]["requests"]["memory"] == "96Mi"
    service = by_kind(docs, "Service")
    assert {p["port"] for p in service["spec"]["ports"]} == {9400, 9401, 9478}
    dashboard = by_kind(docs, "ConfigMap")
    assert dashboard["data"]["gpu-node-agent-dashboard.json"] == (
        ROOT / "daemonset/monitoring/gpu-node-agent-dashboard.json").read_text()


def test_prometheus_rule_is_the_rule_files() -> None:
    """The PrometheusRule ships the alerts and the recording rules the dashboard reads."""
    rule = by_kind(render("daemonset/base"), "PrometheusRule")
    groups = [group for name in ("alerts", "rules") for group in yaml.safe_load(
        (ROOT / f"daemonset/monitoring/gpu-node-agent-{name}.yaml").read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    monitor = by_kind(render("daemonset/base"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_openshift_scc_is_bound_to_the_service_account() -> None:
    docs = render("daemonset/overlays/openshift")
    scc = by_kind(docs, "SecurityContextConstraints")
    account = by_kind(docs, "ServiceAccount")
    subject = f"system:serviceaccount:{account['metadata']['namespace']}:" \
              f"{account['metadata']['name']}"
    assert scc["users"] == [subject]
    assert "namespace" not in scc["metadata"]  # cluster-scoped
    role = by_name(docs, "ClusterRole", "gpu-node-agent-scc")
    assert role["rules"][0]["resourceNames"] == [scc["metadata"]["name"]]
    assert role["rules"][0]["verbs"] == ["use"]
    binding = by_name(docs, "RoleBinding", "gpu-node-agent-scc")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent",
                                    "namespace": "gpu-node-agent"}]
    pod = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    assert scc["allowHostPID"] is pod["hostPID"] is True
    assert {k for v in pod["volumes"] for k in v if k != "name"} <= set(scc["volumes"])


def test_openshift_scc_admits_the_kubelet_plugin_container() -> None:
    """On OpenShift the plugin runs as spc_t (kubelet's sockets, the agent's socket) and
    stays unprivileged; the SCC admits that: any SELinux type, no required capability."""
    docs = render("daemonset/overlays/openshift")
    scc = by_kind(docs, "SecurityContextConstraints")
    pod = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    plugin = container(pod, "kubelet-plugin")
    context = plugin["securityContext"]
    assert context["seLinuxOptions"] == {"type": "spc_t"}
    assert scc["seLinuxContext"]["type"] == "RunAsAny"
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert scc["requiredDropCapabilities"] == [] and scc["runAsUser"]["type"] == "RunAsAny"
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert scc["seccompProfiles"] == ["*"]


#: Kinds without a namespace (kustomize does not know all of them, so nothing may stamp one).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "SecurityContextConstraints"}


#: Objects that must live beside something of another namespace: the mig-manager overlay's
#: grant to read the GPU Operator's mig-parted ConfigMap, in that ConfigMap's namespace.
ELSEWHERE = {("Role", "gpu-node-agent-mig-config"): "gpu-operator",
             ("RoleBinding", "gpu-node-agent-mig-config"): "gpu-operator"}


@pytest.mark.parametrize("tree", TREES)
def test_namespaced_objects_and_only_they_name_the_namespace(tree: str) -> None:
    """Every namespaced object is in the agent's namespace (or, named in ELSEWHERE, beside
    what it grants); no cluster-scoped one names a namespace (a DeviceClass or a policy with
    one is at best misleading)."""
    for doc in render(tree):
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in CLUSTER_SCOPED:
            assert namespace is None, doc["kind"]
        else:
            expected = ELSEWHERE.get((doc["kind"], doc["metadata"]["name"]), "gpu-node-agent")
            assert namespace == expected, (doc["kind"], doc["metadata"]["name"])
