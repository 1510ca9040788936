"""Slices made on demand for a claim: which GPU and placement (fragmentation-aware, on fresh
walks, counting slices reserved but not yet made), reserved in the ledger, recorded durably,
then made and destroyed through the one door to the MIG instances (:class:`MigDevices`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from agent.claims.cdi_writer import CdiWriter
from agent.claims.checkpoint import ClaimCheckpoint, ClaimRecord, PreparedDevice, SliceRecord
from agent.claims.placement import Candidate, choose
from agent.claims.records import hold_of, key_of_device
from agent.claims.requests import DeviceRequest
from agent.device_names import mig_device_name, parse_device_name, profile_label
from agent.errors import (
    DeviceBusy,
    DeviceUnavailable,
    InvalidRequest,
    MigNotEnabled,
    NoSliceRoom,
)
from agent.gpu.types import Gpu, Placement
from agent.ledger.ledger import NodeLedger
from agent.mig.catalog import catalog_of
from agent.mig.devices import MigDevices, PlacementTaken
from agent.mig.geometry import Geometry, Instance
from agent.mig.mode import slice_ready

#: Choices tried before giving up: another prepare (or the hardware) took each one meanwhile.
ATTEMPTS = 5


class ClaimSlices:
    def __init__(self, *, ledger: NodeLedger, devices: MigDevices, checkpoint: ClaimCheckpoint,
                 cdi: CdiWriter) -> None:
        self._ledger = ledger
        self._devices = devices
        self._checkpoint = checkpoint
        self._cdi = cdi

    async def make(self, record: ClaimRecord, request: str, *, profile: str | None,
                   gpu_ref: str | None, start: int | None, device_name: str | None,
                   gpus: Sequence[Gpu], admin_access: bool = False) -> None:
        """Make a slice for the claim and add it to ``record`` (durably, before its GPU
        instance exists: a crash from there on is rolled back at start-up, destroying exactly
        this slice). ``device_name`` is a dynamic ResourceSlice device the scheduler
        allocated, which fixes profile, GPU and start."""
        if admin_access:  # a slice made for a monitor would be a device nobody else has
            raise InvalidRequest("devices: admin_access is for existing devices, not slices made "
                                 "on demand", [{"field": "devices.admin_access",
                                                "reason": "only with kind 'gpu'"}])
        asked = slice_spec(profile=profile, gpu_ref=gpu_ref, start=start,
                           device_name=device_name, gpus=gpus)
        profile, gpu_ref, start, candidates = asked.profile, asked.gpu_ref, asked.start, \
            asked.candidates
        if gpu_ref is not None:
            self._ledger.check_usable(candidates[0])  # a pinned GPU says why it cannot serve
        # A device the scheduler allocated from --dynamic-mig slices may switch MIG on.
        ready = [g for g in candidates if slice_ready(g, allocated=device_name is not None)]
        usable = [g for g in ready if not self._ledger.condition(g)]
        mig_off = [g.index for g in candidates if g not in ready]
        if not ready:
            raise _mig_not_enabled(profile, candidates, pinned=gpu_ref is not None)
        if not usable:
            raise DeviceUnavailable(
                f"no MIG-enabled GPU can take a {profile} slice now: " + "; ".join(
                    f"GPU {g.index}: {', '.join(self._ledger.condition(g))}" for g in ready),
                gpu=ready[0].uuid if gpu_ref is not None else None,
                reason="; ".join(r for g in ready for r in self._ledger.condition(g)))
        # Choose on fresh walks, reserve the choice in the ledger (counted by every later
        # choice, so concurrent prepares spread over free placements), then make it under
        # the GPU's mutation lock, which checks it still holds; retry if not. No lock is held
        # across GPUs, so slices on different GPUs are made in parallel.
        for _ in range(ATTEMPTS):
            choice = await self._choose(profile, start, usable)
            if choice is None:
                break
            gpu, placement = choice
            spec = next(p for p in gpu.profiles if p.name == profile)
            name = mig_device_name(gpu.static.minor, profile, spec.id, placement.start)
            device = PreparedDevice(
                request=request, kind="mig", gpu=gpu.uuid, device_name=name,
                cdi_device=self._cdi.qualified_name(record.uid, name),
                slice=SliceRecord(gpu=gpu.uuid, profile=profile, profile_id=spec.id,
                                  start=placement.start, size=placement.size))
            try:
                self._ledger.take(hold_of(record.uid, device, profile), name=name)
            except DeviceBusy:
                continue  # reserved by another prepare since the choice: choose again
            try:
                made = await self._devices.make_slice(
                    record.uid, gpu, profile, placement,
                    record=partial(self._record, record, device))
            except PlacementTaken:
                self._ledger.release(record.uid, key_of_device(device))
                continue  # the hardware changed under the choice: choose again
            except DeviceBusy:  # a transition took the GPU meanwhile
                if device not in record.devices:
                    self._ledger.release(record.uid, key_of_device(device))
                if gpu_ref is not None:
                    raise
                continue
            device.gi_id, device.ci_id, device.uuid = made.gi_id, made.ci_id, made.uuid
            assert device.slice is not None
            device.slice.gi_id, device.slice.ci_id = made.gi_id, made.ci_id
            return
        busy = [self._ledger.busy(g.uuid) for g in usable]
        if gpu_ref is not None and busy[0] is not None:
            raise DeviceBusy(f"GPU {usable[0].index} is busy with MIG transition {busy[0]}",
                             gpu=usable[0].uuid, transition=busy[0])
        raise _no_room(profile, start, usable, mig_off, pinned=gpu_ref is not None)

    async def _record(self, record: ClaimRecord, device: PreparedDevice) -> None:
        record.devices.append(device)
        self._checkpoint.data.claims[record.uid] = record
        await self._checkpoint.commit()

    async def destroy(self, device: PreparedDevice, gpus: Sequence[Gpu]) -> None:
        """Destroy a slice the claim made (waiting for a transition on its GPU)."""
        made = device.slice
        assert made is not None
        gpu = next((g for g in gpus if g.uuid == made.gpu), None)
        if gpu is None:  # lost (off the bus): the claim keeps its record until it is back
            reason = "its GPU does not answer (lost or gone)"
            raise DeviceUnavailable(f"slice {device.device_name} cannot be destroyed: {reason}",
                                    gpu=made.gpu, device=device.device_name, reason=reason)
        await self._devices.destroy_slice(gpu, made.profile, Placement(made.start, made.size))

    async def _choose(self, profile: str, start: int | None,
                      usable: Sequence[Gpu]) -> tuple[Gpu, Placement] | None:
        idle = [gpu for gpu in usable if self._ledger.busy(gpu.uuid) is None]
        walks = await asyncio.gather(*(self._devices.geometry(gpu) for gpu in idle))
        # From here to the caller's reservation nothing awaits: the reservations counted now
        # are exactly those made before this choice.
        candidates = []
        for gpu, geometry in zip(idle, walks, strict=True):
            # Slices reserved in the ledger but not made yet count as taken too.
            extra: list[Instance] = []
            for hold in self._ledger.holds(gpu.uuid):
                placement = hold.key.placement
                if hold.profile is None or placement is None or hold.admin:
                    continue
                if not any(i.placement.overlaps(placement)
                           for i in (*geometry.instances, *extra)):
                    extra.append(Instance(hold.profile, placement))
            candidates.append(Candidate(gpu.index, catalog_of(gpu.profiles), Geometry(
                mig_enabled=True, instances=(*geometry.instances, *extra))))
        choice = choose(candidates, profile, start)
        if choice is None:
            return None
        return next(g for g in idle if g.index == choice.index), choice.placement


@dataclass(frozen=True)
class SliceSpec:
    """What a slice request asks for, checked against the node."""

    profile: str
    gpu_ref: str | None
    """The pinned GPU (UUID or index), if any."""
    start: int | None
    candidates: list[Gpu]
    """The MIG-capable GPUs it may go on."""


def slice_spec(*, profile: str | None, gpu_ref: str | None, start: int | None,
               device_name: str | None, gpus: Sequence[Gpu], where: str = "devices") -> SliceSpec:
    """The profile, pinned GPU (UUID or index), start and candidate GPUs of a slice request
    (pure): a dynamic ResourceSlice ``device_name`` fixes the first three.
    :class:`InvalidRequest` naming ``where`` (``devices[2]``) for a name that is no MIG device
    of this node, an unknown GPU or an unknown profile."""
    if device_name is not None:
        parsed = parse_device_name(device_name)
        if parsed is None or parsed.profile_id is None:
            raise InvalidRequest(f"{where}.device: {device_name!r} is not a MIG device name "
                                 "like gpu-0-mig-1g10gb-19-0",
                                 [{"field": f"{where}.device",
                                   "reason": "not a MIG device name"}])
        gpu = next((g for g in gpus if g.static.minor == parsed.minor), None)
        spec = next((p for p in gpu.profiles if p.id == parsed.profile_id
                     and profile_label(p.name) == parsed.profile), None) if gpu else None
        if gpu is None or spec is None:
            raise InvalidRequest(f"{where}.device: no GPU or profile on this node for "
                                 f"{device_name!r}",
                                 [{"field": f"{where}.device", "reason": "unknown device"}])
        profile, gpu_ref, start = spec.name, gpu.uuid, parsed.start
    if profile is None:
        raise InvalidRequest(f"{where}: a slice names a profile or a device",
                             [{"field": f"{where}.profile", "reason": "missing"}])
    candidates = [g for g in gpus if g.static.mig_capable and (
        gpu_ref is None or gpu_ref in (g.uuid, str(g.index)))]
    if gpu_ref is not None and not candidates:
        raise InvalidRequest(f"{where}.gpu: no MIG-capable GPU {gpu_ref!r}",
                             [{"field": f"{where}.gpu", "reason": "unknown GPU"}])
    known = {p.name for g in candidates for p in g.profiles}
    if profile not in known:
        raise InvalidRequest(f"{where}.profile: unknown MIG profile {profile!r}; known: "
                             f"{', '.join(sorted(known))}",
                             [{"field": f"{where}.profile", "reason": "unknown profile"}])
    return SliceSpec(profile, gpu_ref, start, candidates)


def check_slices(requests: Sequence[DeviceRequest], gpus: Sequence[Gpu]) -> None:
    """Refuse a claim whose slices name no MIG device, GPU or profile of this node (pure,
    before anything is reserved), naming the entry."""
    for position, request in enumerate(requests):
        if request.kind == "slice":
            slice_spec(profile=request.profile, gpu_ref=request.gpu, start=request.start,
                       device_name=request.device, gpus=gpus, where=f"devices[{position}]")


def gpus_for(requests: Sequence[DeviceRequest], gpus: Sequence[Gpu]) -> frozenset[str]:
    """The UUIDs of the GPUs, of the snapshot ``gpus``, that a claim of slices only may go
    on: each slice a dynamic device name or a GPU pins; empty for every GPU (a slice that
    may go anywhere, an existing device, or a reference the snapshot does not resolve)."""
    found: set[str] = set()
    for request in requests:
        if request.kind != "slice":
            return frozenset()
        parsed = parse_device_name(request.device) if request.device is not None else None
        gpu = next((g for g in gpus if (
            parsed is not None and g.static.minor == parsed.minor) or (
            parsed is None and request.gpu is not None
            and request.gpu in (g.uuid, str(g.index)))), None)
        if gpu is None:
            return frozenset()
        found.add(gpu.uuid)
    return frozenset(found)


def _gpu_list(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices)


def _mig_not_enabled(profile: str, candidates: Sequence[Gpu], *, pinned: bool) -> MigNotEnabled:
    """The refusal of a slice where no GPU it may go on has MIG on, saying what to do."""
    off = [g.index for g in candidates]
    if pinned:
        detail = (f"GPU {off[0]} has MIG off, so no {profile} slice can be made on it: enable "
                  f"MIG on it (PUT /v1/gpus/{off[0]}/mig) or request the whole GPU")
    else:
        detail = (f"no GPU has MIG enabled, so no {profile} slice can be made (MIG off on GPU "
                  f"{_gpu_list(off)}): enable MIG on one (PUT /v1/gpus/{{gpu}}/mig) or "
                  "request a whole GPU")
    return MigNotEnabled(detail, profile=profile, mig_off=off,
                         gpu=candidates[0].uuid if pinned else None)


def _no_room(profile: str, start: int | None, usable: Sequence[Gpu], mig_off: Sequence[int],
             *, pinned: bool) -> NoSliceRoom:
    """The refusal of a slice no MIG-enabled GPU has room for, saying what would make room."""
    at = f" at memory slice {start}" if start is not None else ""
    tried = [g.index for g in usable]
    detail = (f"GPU {tried[0]} has no room for {profile}{at}: " if pinned else
              f"no MIG-enabled GPU ({_gpu_list(tried)}) has room for {profile}{at}: ")
    if mig_off:
        detail += (f"{len(mig_off)} GPU{'s' if len(mig_off) != 1 else ''} "
                   f"({_gpu_list(mig_off)}) {'have' if len(mig_off) != 1 else 'has'} MIG off; "
                   "enable MIG on one (PUT /v1/gpus/{gpu}/mig), ")
    detail += ("release a slice or change the geometry (GET /v1/gpus/{gpu}/mig shows what is "
               "held)" if start is None else "release the slice there or ask for another start")
    return NoSliceRoom(detail, profile=profile, start=start, gpus=tried, mig_off=mig_off,
                       gpu=usable[0].uuid if pinned else None)
