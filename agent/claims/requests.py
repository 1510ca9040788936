"""What a claim asks for, and the digest that tells a retry of the same prepare from a prepare
of other devices."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Literal

from agent.claims.sharing import SharingConfig


@dataclass(frozen=True)
class DeviceRequest:
    """One device a claim asks for: an existing one (``kind="gpu"``) by any of its names, or a
    MIG slice made on demand (``kind="slice"``) by profile (optionally GPU and start) or by a
    dynamic ResourceSlice device name."""

    request: str
    kind: Literal["gpu", "slice"]
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


#: Fields added after the first checkpoints: in the digest only when set, so requests
#: recorded before they existed keep their digest and their retries after an upgrade still
#: answer the same claim.
_NEWER_FIELDS = frozenset({"admin_access", "sharing", "memory_mib", "share_id"})


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
