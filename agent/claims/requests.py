"""What a claim asks for, and the digest that tells a retry of the same prepare from a prepare
of other devices."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Literal

from agent.claims.sharing import SharingConfig
from agent.device_names import parse_device_name

#: How a claim's devices are named: ``any`` of a device's names (UUID, index, ...), or only
#: ``resourceslice`` device names, as the kubelet plugin passes an allocation through (the
#: answer then names each device exactly as the allocation did).
DeviceNames = Literal["any", "resourceslice"]


@dataclass(frozen=True)
class DeviceRequest:
    """One device a claim asks for: an existing one (``kind="gpu"``) by any of its names, a
    MIG slice made on demand (``kind="slice"``) by profile (optionally GPU and start) or by a
    dynamic ResourceSlice device name, or the IMEX channel of a compute domain
    (``kind="imex-channel"``, ``domain``)."""

    request: str
    kind: Literal["gpu", "slice", "imex-channel"]
    device: str | None = None
    profile: str | None = None
    gpu: str | None = None
    start: int | None = None
    #: DRA ``adminAccess``: held non-exclusively, for monitoring (existing devices only).
    admin_access: bool = False
    #: GPU sharing (MPS, time-slicing) and a counted memory share (MiB) of a full GPU, with
    #: the allocation's shareID (existing devices only).
    sharing: SharingConfig | None = None
    memory_mib: int | None = None
    share_id: str | None = None
    #: ``kind="imex-channel"``: the compute domain whose IMEX channel the claim holds.
    domain: str | None = None


#: Fields added after the first checkpoints: in the digest only when set, so requests
#: recorded before they existed keep their digest and their retries after an upgrade still
#: answer the same claim.
_NEWER_FIELDS = frozenset({"admin_access", "sharing", "memory_mib", "share_id", "domain"})


_FIELDS = tuple(f.name for f in fields(DeviceRequest))


def _plain(value: object) -> object:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


def digest(requests: Sequence[DeviceRequest]) -> str:
    """The requests' digest, recorded with the claim. (Field by field: ``asdict`` of a whole
    request deep-copies it, a visible share of a prepare's CPU; the JSON is the same.)"""
    return hashlib.sha256(json.dumps([
        {name: _plain(value) for name in _FIELDS
         if (value := getattr(r, name)) or name not in _NEWER_FIELDS} for r in requests],
        sort_keys=True).encode()).hexdigest()[:32]


def resourceslice_name_errors(requests: Sequence[DeviceRequest]) -> list[dict[str, Any]]:
    """The entries of a claim that ``device_names="resourceslice"`` refuses (pure): each
    existing device must be named ``gpu-<minor>`` or ``gpu-<minor>-mig-<profile>-<id>-<start>``
    and each slice by a MIG device name; a GPU index, a UUID or a slice by profile is not a
    name the scheduler allocates. Whether the node has the device is checked later, with the
    rest of the claim, before anything is reserved."""
    errors = []
    for position, request in enumerate(requests):
        if request.kind == "imex-channel":
            continue  # named by its domain, not by a ResourceSlice device
        parsed = parse_device_name(request.device) if request.device is not None else None
        if parsed is None:
            reason = "not a ResourceSlice device name"
        elif request.kind == "slice" and parsed.profile is None:
            reason = "not a MIG device name"
        else:
            continue
        errors.append({"field": f"devices[{position}].device", "reason": reason,
                       "device": request.device})
    return errors
