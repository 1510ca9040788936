"""Device taints as the tests meet them in a real API server: a device's taints in its
ResourceSlice, claim requests that tolerate them, and what the device taint eviction
controller leaves on a pod it evicts (tests/k8s/src/evict.go)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tests.k8s.harness import ApiServer
from tests.k8s.objects import DRIVER
from tests.k8s.stack import server_slices

Json = dict[str, Any]
XID_KEY = f"{DRIVER}/xid"
LOST_KEY = f"{DRIVER}/gpu-lost"
#: What the eviction controller writes on a pod before it deletes it (kube-controller-manager's
#: device taint manager).
EVICTION_REASON = "DeletionByDeviceTaintManager"
#: Whether a claim's NoExecute toleration keeps its pod running. The eviction controller reads
#: tolerations from the allocation result, and 1.34's allocator never copies them there
#: (kubernetes/kubernetes#134434, fixed in 1.35 by #134479, not in 1.34.4): on 1.34 every pod
#: on a NoExecute-tainted device is evicted, tolerated or not.
TOLERATION_PROTECTS = {"1.34": False, "1.37": True}


def toleration(key: str = XID_KEY, *, operator: str = "Exists", value: str | None = None,
               effect: str | None = None) -> Json:
    """One ResourceClaim request toleration (``effect`` None: every effect)."""
    found: Json = {"key": key, "operator": operator}
    if value is not None:
        found["value"] = value
    if effect is not None:
        found["effect"] = effect
    return found


def tolerating(claim: Json, tolerations: Sequence[Json]) -> Json:
    """``claim`` with these tolerations on each of its requests."""
    for req in claim["spec"]["devices"]["requests"]:
        req["exactly"]["tolerations"] = list(tolerations)
    return claim


def slice_devices(server: ApiServer, node: str) -> dict[str, Json]:
    """Every device the server's slices of ``node`` list, by name."""
    return {d["name"]: d for s in server_slices(server, node) for d in s["spec"].get("devices", [])}


def device_taints(server: ApiServer, node: str, device: str) -> list[Json] | None:
    """The taints the server holds on ``device`` of ``node`` ([] when untainted), or None when
    no slice lists the device."""
    found = slice_devices(server, node).get(device)
    return None if found is None else list(found.get("taints", []))


def pod_object(server: ApiServer, name: str, namespace: str = "default") -> Json | None:
    """The Pod as the server holds it, None once it is gone."""
    status, body = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    if status == 404:
        return None
    assert status == 200, body
    return dict(body)


def disruption(pod: Json) -> Json | None:
    """The pod's ``DisruptionTarget`` condition, if it has one."""
    return next((c for c in pod.get("status", {}).get("conditions", [])
                 if c["type"] == "DisruptionTarget"), None)


def evicted(server: ApiServer, name: str, namespace: str = "default") -> Json | None:
    """The pod once the eviction controller has evicted it: the ``DisruptionTarget``
    condition with its reason, and deleted (a deletion timestamp: no kubelet confirms the
    graceful deletion, so the object stays). None until then."""
    pod = pod_object(server, name, namespace)
    assert pod is not None, f"pod {namespace}/{name} is gone without a deletion grace period"
    condition = disruption(pod)
    if condition is None or pod["metadata"].get("deletionTimestamp") is None:
        return None
    return pod


def untouched(server: ApiServer, name: str, namespace: str = "default") -> bool:
    """Whether the pod is there, not being deleted, with no ``DisruptionTarget`` condition."""
    pod = pod_object(server, name, namespace)
    return (pod is not None and pod["metadata"].get("deletionTimestamp") is None
            and disruption(pod) is None)
