"""What a claim's record stands for, as pure functions of it: the ledger holds it keeps, the
sharing it recorded, whether undoing it touches the hardware, and the details its events
carry."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from agent.claims.checkpoint import ClaimRecord, DeviceSharingRecord, PreparedDevice
from agent.claims.sharing import MEMORY_MIB, DevicePlan
from agent.gpu.types import Gpu, Placement
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import Hold, Share

#: A recorded hold is a fact: at start-up it is put back whatever the capacity says.
UNBOUNDED = {MEMORY_MIB: 2**62}


def key_of_device(device: PreparedDevice) -> DeviceKey:
    """The ledger key of a recorded device: its GPU and, for a MIG device, its memory slices
    (a record written before placements were recorded gets its placement at load)."""
    if device.kind == "gpu":
        return DeviceKey(device.gpu)
    if device.slice is not None:
        return DeviceKey(device.gpu, Placement(device.slice.start, device.slice.size))
    assert device.placement is not None, "filled in at load"
    return DeviceKey(device.gpu, Placement(*device.placement))


def hold_of(uid: str, device: PreparedDevice, profile: str | None, *,
            state: Literal["reserved", "prepared"] = "reserved") -> Hold:
    """The ledger hold of claim ``uid`` on a recorded device."""
    share = device.share
    shares = (Share(MEMORY_MIB, share.memory_mib),) if share is not None and share.counted \
        else ()
    return Hold(uid, key_of_device(device), state, profile=profile,
                on_demand=device.slice is not None, admin=device.admin_access, shares=shares)


def sharing_record(device: DevicePlan | None) -> DeviceSharingRecord | None:
    """A device's planned sharing, as the checkpoint records it."""
    if device is None or device.strategy is None:
        return None
    return DeviceSharingRecord(strategy=device.strategy, interval=device.interval,
                               timeslice=device.timeslice,
                               exclusive_process=device.exclusive_process,
                               thread_percentage=device.thread_percentage,
                               pinned_mib=device.pinned_mib)


def has_effects(record: ClaimRecord) -> bool:
    """Whether undoing the claim touches the hardware beyond its holds and spec."""
    return bool(record.daemons()) or any(d.sharing_state is not None for d in record.devices)


def mps_roots(record: ClaimRecord) -> dict[str, Path]:
    """The directory of the MPS daemon serving each of the claim's MPS devices, by UUID."""
    return {uuid: Path(daemon.root) for daemon in record.daemons() for uuid in daemon.devices}


def present(device: PreparedDevice, gpus: Mapping[str, Gpu]) -> bool:
    """Whether the recorded device is on the node (``gpus`` by UUID)."""
    gpu = gpus.get(device.gpu)
    if gpu is None:
        return False
    if device.kind == "gpu":
        return True
    return any(d.uuid == device.uuid for d in gpu.mig_devices)


def claim_details(record: ClaimRecord) -> dict[str, object]:
    """An event's details for a claim: its uid and the GPUs (UUIDs) it holds, so the event's
    log line names them."""
    return {"claim": record.uid, "gpus": sorted({d.gpu for d in record.devices})}
