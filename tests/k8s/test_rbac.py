"""The RBAC the issue gives the kubelet plugin, checked by a real kube-apiserver (RBAC
authorizer) through a ServiceAccount token minted with ``kubectl create token``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import StartApiServer
from tests.k8s.harness import SLICE_RULES, VERSIONS
from tests.k8s.published import slices_of

SLICES = "/apis/resource.k8s.io/v1/resourceslices"

# resourceslices: CRUD and watch; resourceclaims: get; nodes: get (issue 14, Deploy).
RULES = [
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
     "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_role_publishes_slices_and_nothing_more(
        version: str, kube_apiservers: StartApiServer, agent_node: StartAgent,
        tmp_path: Path) -> None:
    """With only the plugin's ClusterRole, a ServiceAccount token creates, lists, updates and
    deletes the agent's slices, reads claims and its Node, and is refused (403) writing
    Nodes, reading Secrets and writing claim status."""
    server = kube_apiservers(version)
    name = f"rbac-v{version}".replace(".", "-")
    server.apply([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": name}, "rules": RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": name},
         "subjects": [{"kind": "ServiceAccount", "namespace": "default", "name": name}]},
    ])
    kubeconfig = server.service_account_kubeconfig("default", name, tmp_path / "sa.kubeconfig")
    token = json.loads(kubeconfig.read_text())["users"][0]["user"]["token"]
    server.ensure_node(name)
    agent = agent_node("l40s", node_name=name)
    item = slices_of(agent, SLICE_RULES[version])[0]
    path = f"{SLICES}/{item['metadata']['name']}"

    assert server.request("POST", SLICES, item, token=token)[0] == 201
    status, stored = server.request("GET", path, token=token)
    assert status == 200
    assert server.request("PUT", path, stored, token=token)[0] == 200
    assert server.request("GET", f"{SLICES}?fieldSelector=spec.nodeName={name}",
                          token=token)[0] == 200
    assert server.request("GET", f"/api/v1/nodes/{name}", token=token)[0] == 200
    assert server.request("GET", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/x",
                          token=token)[0] == 404
    assert server.request("DELETE", path, token=token)[0] == 200
    for method, denied in (("DELETE", f"/api/v1/nodes/{name}"),
                           ("GET", "/api/v1/namespaces/default/secrets"),
                           ("PUT", "/apis/resource.k8s.io/v1/namespaces/default/"
                                   "resourceclaims/x/status")):
        assert server.request(method, denied, {} if method == "PUT" else None,
                              token=token)[0] == 403, (method, denied)
    assert kubeconfig.stat().st_mode & 0o777 == 0o600
    assert server.kubectl("get", "resourceslices", kubeconfig=kubeconfig).returncode == 0
    refused = server.kubectl("get", "secrets", kubeconfig=kubeconfig, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
