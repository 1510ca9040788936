"""From a ResourceClaim to the agent's claims API and back to kubelet's answer (pure).

A claim may hold devices of several drivers, and of this driver on other nodes' pools (a
network-attached pool, or a claim shared across nodes): only the allocation results of this
driver *and* this node's pool are the agent's to prepare (NVIDIA's plugin once checkpointed
other drivers' results, PR #1371).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The agent's longest request name (a DNS label); a longer ``<request>/<subrequest>`` is not
#: sent as the name (the plugin keeps the request names itself).
MAX_AGENT_REQUEST_NAME = 63


class ClaimError(Exception):
    """One claim cannot be prepared or unprepared; ``reason`` is a short stable label (the
    metrics' ``reason``), the message says what kubelet shows in the pod's events."""

    def __init__(self, reason: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True)
class KubeletClaim:
    """A claim as kubelet names it in a prepare or unprepare call."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class Allocated:
    """One device of this driver and pool in the claim's allocation, with every request of
    the claim it serves."""

    device: str
    pool: str
    requests: tuple[str, ...]
    admin_access: bool


@dataclass(frozen=True)
class PreparedDevice:
    """One device of kubelet's answer."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


def our_devices(claim: KubeletClaim, obj: Mapping[str, Any], *, driver: str,
                pool: str) -> list[Allocated]:
    """The devices of the ResourceClaim ``obj`` that this node's agent prepares, in allocation
    order; a result naming the same device twice (two requests sharing it) is one device
    serving both. :class:`ClaimError` when the object is another claim of the same name
    (deleted and recreated), is not allocated, or holds nothing of ours."""
    meta = obj.get("metadata") or {}
    if meta.get("uid") != claim.uid:
        raise ClaimError("uid-mismatch",
                         f"claim {claim}: the API server's {claim.namespace}/{claim.name} has "
                         f"UID {meta.get('uid')!r} (deleted and created again?)")
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError("not-allocated", f"claim {claim}: not allocated", retryable=True)
    results = ((allocation.get("devices") or {}).get("results")) or []
    found: dict[str, Allocated] = {}
    for result in results:
        if result.get("driver") != driver or result.get("pool") != pool:
            continue
        name = str(result.get("device") or "")
        request = str(result.get("request") or "")
        admin = bool(result.get("adminAccess"))
        if not name or not request:
            raise ClaimError("bad-allocation",
                             f"claim {claim}: an allocation result of {driver} names no "
                             "device or request")
        known = found.get(name)
        if known is None:
            found[name] = Allocated(name, pool, (request,), admin)
        elif request not in known.requests:
            # Exclusive as soon as one of its requests is.
            found[name] = Allocated(name, pool, (*known.requests, request),
                                    known.admin_access and admin)
    if not found:
        drivers = sorted({f"{r.get('driver')}/{r.get('pool')}" for r in results})
        raise ClaimError("no-devices",
                         f"claim {claim}: no device of driver {driver} in pool {pool} is "
                         f"allocated (allocated: {', '.join(drivers) or 'nothing'})")
    return list(found.values())


def agent_body(obj: Mapping[str, Any], devices: Sequence[Allocated], issued_at_ns: int,
               on_demand: Collection[str] = ()) -> dict[str, Any]:
    """The ``PUT /v1/claims/{uid}`` body: each device by its ResourceSlice name, as an
    existing device or (named in ``on_demand``: a partitionable MIG device) a slice to make,
    request names kept, ``admin_access`` for monitoring access; the claim's namespace, name
    and resourceVersion; and when kubelet's call arrived (``issued_at_ns``, CLOCK_BOOTTIME)."""
    entries: list[dict[str, Any]] = []
    for device in devices:
        entry: dict[str, Any] = {"kind": "slice" if device.device in on_demand else "gpu",
                                 "device": device.device}
        if len(device.requests[0]) <= MAX_AGENT_REQUEST_NAME:
            entry["name"] = device.requests[0]
        if device.admin_access:
            entry["admin_access"] = True
        entries.append(entry)
    meta = obj.get("metadata") or {}
    metadata = {key: str(meta[field]) for key, field in (
        ("namespace", "namespace"), ("name", "name"), ("resource_version", "resourceVersion"))
        if meta.get(field)}
    pods = [ref for ref in (obj.get("status") or {}).get("reservedFor") or []
            if ref.get("resource") == "pods" and ref.get("name")]
    if len(pods) == 1:  # a shared claim has many consumers: none is "the" pod
        metadata["pod"] = str(pods[0]["name"])
    return {"devices": entries, "metadata": metadata, "issued_at_ns": issued_at_ns}


def kubelet_devices(claim: KubeletClaim, devices: Sequence[Allocated],
                    answer: Mapping[str, Any]) -> list[PreparedDevice]:
    """Kubelet's devices for the agent's ``answer`` to :func:`agent_body`: each allocated
    device with its requests and the CDI names the agent wrote for it."""
    cdi: dict[str, list[str]] = {}
    for prepared in answer.get("devices") or []:
        cdi.setdefault(str(prepared.get("device_name")), []).extend(
            str(name) for name in prepared.get("cdi_devices") or [])
    out = []
    for device in devices:
        names = cdi.get(device.device)
        if not names:
            raise ClaimError("agent-answer", f"claim {claim}: the agent's answer has no CDI "
                                             f"device for {device.device}")
        out.append(PreparedDevice(device.requests, device.pool, device.device, tuple(names)))
    return out
