"""Workloads through the real kube-scheduler (tests/k8s/harness.py ``KubeScheduler``): objects
created as a user applies them, with what kube-controller-manager (not run here) would add,
and the scheduler's answers read back (the node a pod is bound to, its claims, why a pod
stays Pending)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.harness import ApiServer, KubeScheduler
from tests.waiting import wait_for

RESOURCE = "/apis/resource.k8s.io/v1"
Json = dict[str, Any]


def documents(path: Path) -> list[Json]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def create(server: ApiServer, path: str, body: Json) -> Json:
    status, made = server.request("POST", path, body)
    assert status == 201, made
    return dict(made)


def ensure_namespace(server: ApiServer, namespace: str) -> None:
    status, body = server.request("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    assert status in (201, 409), body


def create_workload(server: ApiServer, docs: Iterable[Json], namespace: str) -> list[str]:
    """ResourceClaimTemplates, ResourceClaims and Pods of ``docs`` in ``namespace``, with what
    kube-controller-manager's resourceclaim controller does for a pod naming a template: a
    claim of the template's spec owned by the pod, and the pod's
    ``status.resourceClaimStatuses`` naming it. The pods' names."""
    ensure_namespace(server, namespace)
    docs = list(docs)
    templates = {}
    for doc in docs:
        if doc["kind"] == "ResourceClaimTemplate":
            templates[doc["metadata"]["name"]] = create(
                server, f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates", doc)
        elif doc["kind"] == "ResourceClaim":
            create(server, f"{RESOURCE}/namespaces/{namespace}/resourceclaims", doc)
    pods = []
    for doc in (d for d in docs if d["kind"] == "Pod"):
        pod = create(server, f"/api/v1/namespaces/{namespace}/pods", doc)
        name = pod["metadata"]["name"]
        statuses = []
        for entry in pod["spec"].get("resourceClaims", []):
            template = entry.get("resourceClaimTemplateName")
            if template is None:
                continue
            claim = create(server, f"{RESOURCE}/namespaces/{namespace}/resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {
                    "generateName": f"{name}-{entry['name']}-",
                    "annotations": {"resource.kubernetes.io/pod-claim-name": entry["name"]},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                                         "uid": pod["metadata"]["uid"], "controller": True,
                                         "blockOwnerDeletion": True}]},
                "spec": templates[template]["spec"]["spec"]})
            statuses.append({"name": entry["name"],
                             "resourceClaimName": claim["metadata"]["name"]})
        if statuses:
            server.kubectl("patch", "pod", "-n", namespace, name, "--subresource=status",
                           "--type=merge", "-p",
                           json.dumps({"status": {"resourceClaimStatuses": statuses}}))
        pods.append(name)
    return pods


def bound_node(server: ApiServer, scheduler: KubeScheduler, namespace: str, pod: str,
               timeout: float = 60) -> str:
    """The node kube-scheduler bound the pod to (waits for the binding)."""
    def node() -> str | None:
        status, body = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
        assert status == 200, body
        return body["spec"].get("nodeName") or None

    try:
        return str(wait_for(node, f"pod {namespace}/{pod} bound", timeout, every_s=0.05))
    except AssertionError:
        _, body = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
        raise AssertionError(f"{body.get('status')}\n{scheduler.log()}") from None


def claims_of(server: ApiServer, namespace: str, pod: str) -> list[Json]:
    """The pod's ResourceClaims as the server holds them (allocated by the scheduler)."""
    _, body = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    names = [s["resourceClaimName"] for s in body["status"].get("resourceClaimStatuses", [])]
    names += [c["resourceClaimName"] for c in body["spec"].get("resourceClaims", [])
              if c.get("resourceClaimName")]
    extended = body["status"].get("extendedResourceClaimStatus")
    if extended:
        names.append(extended["resourceClaimName"])
    claims = []
    for name in names:
        status, claim = server.request(
            "GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}")
        assert status == 200, claim
        claims.append(claim)
    return claims


def unschedulable(server: ApiServer, namespace: str, pod: str) -> str | None:
    """The scheduler's message on a pod it could not place (``PodScheduled`` False,
    ``Unschedulable``); None while it has said nothing of the kind."""
    _, body = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    for condition in body.get("status", {}).get("conditions", []):
        if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                "PodScheduled", "False", "Unschedulable"):
            return str(condition.get("message", ""))
    return None
