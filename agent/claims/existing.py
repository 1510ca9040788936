"""Existing devices a claim names (a GPU or a MIG device, by any of its names): resolved on an
inventory snapshot, each named once, checked and reserved in the ledger without awaiting, so
check-then-take is atomic."""

from __future__ import annotations

from collections.abc import Sequence

from agent.claims.cdi_writer import CdiWriter
from agent.claims.checkpoint import ClaimRecord, PreparedDevice, ShareRecord
from agent.claims.records import hold_of, sharing_record
from agent.claims.requests import DeviceRequest
from agent.claims.sharing import MEMORY_MIB, DevicePlan
from agent.device_names import gpu_device_name, mig_device_name, shareable_mib
from agent.errors import DeviceBusy, InvalidRequest
from agent.gpu.types import Gpu, MigDevice
from agent.ledger.keys import DeviceKey, key_of, resolve
from agent.ledger.ledger import NodeLedger

Target = tuple[DeviceRequest, Gpu, MigDevice | None]


class Stale(Exception):
    """The inventory snapshot no longer matches the hardware: resolve on a fresh read."""


def targets(requests: Sequence[DeviceRequest], gpus: Sequence[Gpu], *,
            snapshot: bool) -> list[Target]:
    """The existing devices the claim names, each once: the same device (or a GPU and one of
    its MIG devices) named twice is refused, naming both entries, and names of no device on
    the node are refused together, each by its entry (``devices[1].device``), before anything
    is reserved. On a ``snapshot`` a name not found raises :class:`Stale` (the device may have
    been made since)."""
    found: list[Target] = []
    seen: list[tuple[int, DeviceKey]] = []
    unknown: list[tuple[int, str]] = []
    for position, request in enumerate(requests):
        if request.kind != "gpu":
            continue
        try:
            gpu, device = resolve(request.device or "", gpus)
        except InvalidRequest:
            if snapshot:
                raise Stale from None
            unknown.append((position, request.device or ""))
            continue
        key = key_of(gpu, device)
        for earlier, other in seen:
            if other.conflicts(key):
                raise InvalidRequest(
                    f"devices[{earlier}] ({requests[earlier].device!r}) and "
                    f"devices[{position}] ({request.device!r}) name the same device",
                    [{"field": f"devices[{earlier}].device", "reason": "same device as "
                      f"devices[{position}]"},
                     {"field": f"devices[{position}].device", "reason": "same device as "
                      f"devices[{earlier}]"}])
        seen.append((position, key))
        found.append((request, gpu, device))
    if unknown:
        named = ", ".join(f"devices[{position}].device {name!r}" for position, name in unknown)
        raise InvalidRequest(
            f"{named}: no such device on this node (a GPU UUID or index, a MIG UUID, "
            "<gpu>:<mig>, or a ResourceSlice device name); nothing was reserved",
            [{"field": f"devices[{position}].device", "reason": "unknown device"}
             for position, _ in unknown])
    return found


def reserve(ledger: NodeLedger, cdi: CdiWriter, record: ClaimRecord, target: Target, *,
            shared: DevicePlan | None = None) -> None:
    """Check the device can be handed out, reserve it in the ledger and add it to the
    record (no await)."""
    request, gpu, device = target
    uid = record.uid
    ledger.check_usable(gpu, device)
    if device is None:
        if gpu.mig_mode is not None and gpu.mig_mode.current:
            raise DeviceBusy(f"GPU {gpu.index} has MIG enabled: claim one of its MIG devices "
                             "or a slice, not the whole GPU", gpu=gpu.uuid)
        busy = ledger.busy(gpu.uuid)
        if busy is not None and not request.admin_access:  # an admin hold blocks nothing
            raise DeviceBusy(f"GPU {gpu.index} is busy with MIG transition {busy}",
                             gpu=gpu.uuid, transition=busy)
        name = gpu_device_name(gpu.static.minor)
        prepared = PreparedDevice(request=request.request, kind="gpu", gpu=gpu.uuid,
                                  uuid=gpu.uuid, device_name=name,
                                  cdi_device=cdi.qualified_name(uid, name),
                                  admin_access=request.admin_access)
        profile = None
    else:
        spec = next(p for p in gpu.profiles if p.name == device.profile)
        name = mig_device_name(gpu.static.minor, device.profile, spec.id,
                               device.placement.start)
        prepared = PreparedDevice(
            request=request.request, kind="mig", gpu=gpu.uuid, uuid=device.uuid,
            gi_id=device.gi_id, ci_id=device.ci_id, device_name=name,
            placement=(device.placement.start, device.placement.size),
            cdi_device=cdi.qualified_name(uid, name), admin_access=request.admin_access)
        profile = device.profile
    prepared.sharing_state = sharing_record(shared)
    capacity = None
    if request.memory_mib is not None or request.share_id is not None:
        # A shareID without a capacity (a result that consumed none) is a share of the whole
        # device: held exclusively, its ID echoed.
        counted = shared is not None and shared.share_mib is not None
        memory = request.memory_mib if request.memory_mib is not None else \
            device.memory_mib if device is not None else \
            shareable_mib(gpu.static.memory_total_mib)
        prepared.share = ShareRecord(memory_mib=memory, share_id=request.share_id,
                                     counted=counted)
        if counted:
            assert shared is not None and shared.shareable_mib is not None
            capacity = {MEMORY_MIB: shared.shareable_mib}
    ledger.take(hold_of(uid, prepared, profile), name=f"GPU {gpu.index} ({name})"
                if capacity else name, capacity=capacity)
    record.devices.append(prepared)
