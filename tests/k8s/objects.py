"""Kubernetes objects the DRA tests build: DeviceClasses, ResourceClaims, Pods and Nodes for
the agent's driver, as plain resource.k8s.io/v1 dicts."""

from __future__ import annotations

import uuid
from typing import Any

from agent.dra.resource_slices import DEFAULT_DRIVER

DRIVER = DEFAULT_DRIVER
RESOURCE = "resource.k8s.io/v1"

Json = dict[str, Any]


def attr(name: str) -> str:
    """CEL for one of the driver's own attributes of the device under selection."""
    return f'device.attributes["{DRIVER}"].{name}'


# The classes an operator would apply: whole GPUs and MIG devices of this driver.
GPU_CLASS = "gpu.nodeagent.dev"
MIG_CLASS = "mig.gpu.nodeagent.dev"


def device_class(name: str, expression: str) -> Json:
    return {"apiVersion": RESOURCE, "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]}}


def classes() -> list[Json]:
    """DeviceClasses for full GPUs and for MIG devices (static or partitionable)."""
    return [
        device_class(GPU_CLASS, f'device.driver == "{DRIVER}" && {attr("type")} == "gpu"'),
        device_class(MIG_CLASS, f'device.driver == "{DRIVER}" && {attr("type")} == "mig"'),
    ]


def request(name: str = "gpu", *, device_class_name: str = GPU_CLASS, count: int = 1,
            selectors: tuple[str, ...] = (), admin_access: bool = False) -> Json:
    """One exactly-N device request, each selector a CEL expression."""
    exactly: Json = {"deviceClassName": device_class_name, "allocationMode": "ExactCount",
                     "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if admin_access:
        exactly["adminAccess"] = True
    return {"name": name, "exactly": exactly}


def claim(name: str, *requests: Json, match_attribute: str | None = None,
          namespace: str = "default") -> Json:
    """A ResourceClaim with these requests; ``match_attribute`` (an unqualified attribute of
    this driver) constrains all its requests' devices to one value of it."""
    devices: Json = {"requests": list(requests) or [request()]}
    if match_attribute is not None:
        devices["constraints"] = [{"requests": [r["name"] for r in devices["requests"]],
                                   "matchAttribute": f"{DRIVER}/{match_attribute}"}]
    return {"apiVersion": RESOURCE, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"devices": devices}}


def with_allocation(claim_object: Json, allocation: Json) -> Json:
    """The claim as the scheduler leaves it: status.allocation set."""
    return {**claim_object, "status": {"allocation": allocation}}


def node(name: str) -> Json:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def pod(name: str, claims: dict[str, str], *, namespace: str = "default",
        node_name: str | None = None) -> Json:
    """A Pod with one container using every claim (pod claim name -> ResourceClaim name)."""
    spec: Json = {
        "containers": [{"name": "main", "image": "registry.invalid/none",
                        "resources": {"claims": [{"name": c} for c in claims]}}],
        "resourceClaims": [{"name": c, "resourceClaimName": rc} for c, rc in claims.items()],
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def devices_of(slices: list[Json]) -> dict[str, Json]:
    """Every device of these slices by name."""
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def string_attribute(device: Json, name: str) -> str:
    return str(device["attributes"][name]["string"])
