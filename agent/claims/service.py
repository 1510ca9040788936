"""Preparing and unpreparing resource claims: full GPUs, existing MIG devices and MIG slices
made on demand, with CDI specs, a crash-safe checkpoint and reconciliation at start-up.

Concurrency: a lock per claim UID (a retry waits for the first attempt), a lock per GPU for
slice creation (NVML serialises a GPU's mutations anyway), and device reservations taken
without any await between check and take, so two claims can never both get one device. No
node-wide lock is held across NVML calls; checkpoint writes are group-committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

from agent.claims.cdi_writer import CdiWriter
from agent.claims.checkpoint import (
    CheckpointCorrupt,
    CheckpointData,
    ClaimCheckpoint,
    ClaimRecord,
    PreparedDevice,
    SliceRecord,
    decode,
    encode,
)
from agent.claims.placement import Candidate, choose
from agent.device_names import gpu_device_name, mig_device_name, parse_device_name, profile_label
from agent.durable import write_atomic
from agent.errors import (
    CheckpointUnusable,
    ClaimUnprepared,
    Conflict,
    DeviceBusy,
    InvalidRequest,
    NotFound,
    NvmlError,
)
from agent.events import EventLog, Severity
from agent.gpu import mig
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.types import GiProfile, Gpu, MigDevice, Placement
from agent.mig.catalog import catalog_of
from agent.mig.geometry import Geometry, Instance
from agent.mig.service import MigService

log = logging.getLogger("agent.claims")


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


class _Stale(Exception):
    """The inventory snapshot no longer matches the hardware: resolve on a fresh read."""


async def _true() -> bool:
    return True


def _digest(requests: Sequence[DeviceRequest]) -> str:
    return hashlib.sha256(json.dumps([r.__dict__ for r in requests], sort_keys=True)
                          .encode()).hexdigest()[:32]


def _key(device: PreparedDevice) -> str:
    """What two claims must never share: a whole GPU, or a GPU's memory-slice run."""
    if device.kind == "gpu":
        return f"gpu:{device.gpu}"
    start = device.slice.start if device.slice else None
    return f"mig:{device.gpu}:{device.gi_id if start is None else 's' + str(start)}"


class ClaimService:
    def __init__(self, *, session: NvmlSession, inventory: GpuInventory, mig_service: MigService,
                 checkpoint: ClaimCheckpoint, cdi: CdiWriter, events: EventLog,
                 tombstone_s: float = 600.0) -> None:
        self._session = session
        self._inventory = inventory
        self._mig = mig_service
        self.checkpoint = checkpoint
        self.cdi = cdi
        self._events = events
        self._tombstone_s = tombstone_s
        # Per-UID lock and how many calls hold or wait on it; dropped when that reaches 0.
        self._uid_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._gpu_locks: dict[str, asyncio.Lock] = {}
        self._held: dict[str, str] = {}  # device key -> claim uid
        # Slices chosen but not yet made, per GPU: counted by every later choice, so
        # concurrent prepares spread over free placements instead of colliding on one.
        self._pending: dict[str, list[Instance]] = {}
        self.corrupt: CheckpointCorrupt | None = None
        self._node_spec_task: asyncio.Task[None] | None = None
        self._node_spec_lock = asyncio.Lock()
        self._node_spec_again = False
        mig_service.claims = self

    # -- what the MIG service asks (ClaimHolders) --------------------------------------------

    def holders(self, gpu: str) -> Mapping[int, Sequence[str]]:
        found: dict[int, list[str]] = {}
        for record in self.checkpoint.data.claims.values():
            if record.state == "lost":
                continue
            for d in record.devices:
                if d.gpu == gpu and d.gi_id is not None:
                    found.setdefault(d.gi_id, []).append(record.uid)
        return found

    def dynamic_slices(self, gpu: str) -> frozenset[tuple[str, Placement]]:
        return frozenset((d.slice.profile, Placement(d.slice.start, d.slice.size))
                         for r in self.checkpoint.data.claims.values() for d in r.devices
                         if d.slice is not None and d.gpu == gpu)

    # -- reading ---------------------------------------------------------------------------

    def claims(self) -> list[ClaimRecord]:
        return sorted(self.checkpoint.data.claims.values(), key=lambda r: r.created_at)

    def claim(self, uid: str) -> ClaimRecord:
        record = self.checkpoint.data.claims.get(uid)
        if record is None:
            raise NotFound(f"no claim {uid!r} is prepared on this node", claim=uid)
        return record

    def _usable(self) -> None:
        if self.corrupt is not None:
            raise CheckpointUnusable(
                f"{self.corrupt}; claims are frozen until an operator inspects it and either "
                "restores it or accepts an empty checkpoint: 'gpu-agent admin checkpoint' or "
                "POST /v1/admin/claims-checkpoint (see docs/operations.md)")

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, uid: str, requests: Sequence[DeviceRequest],
                      metadata: Mapping[str, str]) -> ClaimRecord:
        """Prepare a claim; a repeat with the same devices returns the same answer."""
        self._usable()
        digest = _digest(requests)
        async with self._claim_lock(uid):
            record = self.checkpoint.data.claims.get(uid)
            if record is not None and record.state == "prepare_completed":
                if record.request_digest != digest:
                    raise Conflict(f"claim {uid} is already prepared with other devices; "
                                   "unprepare it first", claim=uid)
                return record
            self.checkpoint.prune_tombstones(self._tombstone_s)
            unprepared_at = self.checkpoint.data.tombstones.get(uid)
            if unprepared_at is not None:
                raise ClaimUnprepared(
                    f"claim {uid} was unprepared {time.time() - unprepared_at:.0f} s ago; a late "
                    "prepare retry cannot bring it back", claim=uid)
            if record is not None:  # half-done earlier attempt, or lost in a reboot
                await self._undo(record)
            return await self._prepare(uid, requests, metadata, digest)

    async def _prepare(self, uid: str, requests: Sequence[DeviceRequest],
                       metadata: Mapping[str, str], digest: str) -> ClaimRecord:
        """Existing devices resolve against the last inventory snapshot, confirmed by one
        cheap NVML read per device while the checkpoint is written; when the snapshot is out
        of date (or for slices, which walk the GPUs anyway) against a fresh read."""
        snapshot = self._inventory.gpus
        if snapshot and not any(r.kind == "slice" for r in requests):
            try:
                return await self._prepare_on(uid, requests, metadata, digest, snapshot,
                                              confirm=True)
            except _Stale:
                pass
        gpus = await self._inventory.refresh()
        return await self._prepare_on(uid, requests, metadata, digest, gpus, confirm=False)

    async def _prepare_on(self, uid: str, requests: Sequence[DeviceRequest],
                          metadata: Mapping[str, str], digest: str, gpus: Sequence[Gpu], *,
                          confirm: bool) -> ClaimRecord:
        now = time.time()
        record = ClaimRecord(uid=uid, state="prepare_started", devices=[],
                             request_digest=digest, metadata=dict(metadata),
                             created_at=now, updated_at=now)
        try:
            try:
                for request in requests:
                    if request.kind == "gpu":
                        self._reserve(uid, record, self._existing(uid, request, gpus))
            except InvalidRequest:
                if confirm:  # maybe made since the snapshot
                    raise _Stale from None
                raise
            for request in requests:
                if request.kind == "slice":
                    await self._make_slice(uid, record, request, gpus)
            record.cdi_spec = str(self.cdi.claim_path(uid))
            record.state = "prepare_completed"
            record.updated_at = time.time()
            self.checkpoint.data.claims[uid] = record
            if not await self._record(record, requests, gpus, confirm=confirm):
                raise _Stale  # recorded on a stale snapshot: undone just below
        except BaseException:
            await self._undo(record)
            raise
        self._events.append("claim.prepared", f"claim {uid} prepared: " + ", ".join(
            d.device_name for d in record.devices), details={"claim": uid})
        return record

    async def _record(self, record: ClaimRecord, requests: Sequence[DeviceRequest],
                      gpus: Sequence[Gpu], *, confirm: bool) -> bool:
        """Make a completed claim durable and write its spec; with ``confirm``, whether the
        snapshot it was resolved on still matches the hardware.

        The checkpoint write starts first; while it is fsync'd the snapshot is confirmed (an
        NVML read can take 0.1-0.5 ms on a real GPU) and the spec written, and this waits for
        all three. A crash between the two writes, in either order, is repaired at start-up:
        specs are rebuilt for completed claims and removed when no claim owns them."""
        committed = self.checkpoint.commit()
        confirmed = asyncio.ensure_future(self._session.read(
            partial(self._still_there, requests, gpus)) if confirm else _true())
        minors = {g.uuid: g.static.minor for g in gpus}
        # On the loop: a claim spec is a few KiB written without fsync to /var/run/cdi, a
        # tmpfs on hosts (tens of microseconds); handing it to a thread cost more than that.
        try:
            self.cdi.write_claim(record.uid, [(d, minors[d.gpu]) for d in record.devices])
        except BaseException:
            await asyncio.gather(committed, confirmed, return_exceptions=True)
            raise
        _, still_there = await asyncio.gather(committed, confirmed)
        return bool(still_there)

    def _still_there(self, requests: Sequence[DeviceRequest], gpus: Sequence[Gpu]) -> bool:
        """Whether the hardware still shows what the snapshot says of every requested device:
        a MIG device still answers, a GPU still has the snapshot's MIG mode and is not lost
        (NVML worker thread)."""
        try:
            for request in requests:
                gpu, device = _resolve(request.device or "", gpus)
                if device is not None:
                    self._session.call("nvmlDeviceGetHandleByUUID", device.uuid, gpu=gpu.uuid)
                    continue
                handle = self._session.gpu_handle(gpu.uuid)
                if not gpu.static.mig_capable:
                    self._session.call("nvmlDeviceGetMinorNumber", handle, gpu=gpu.uuid)
                    continue
                current, _ = self._session.call("nvmlDeviceGetMigMode", handle, gpu=gpu.uuid)
                if gpu.mig_mode is None or bool(current) != gpu.mig_mode.current:
                    return False
        except (InvalidRequest, NvmlError):
            return False
        return True

    def _reserve(self, uid: str, record: ClaimRecord, device: PreparedDevice) -> None:
        key = _key(device)
        holder = self._held.get(key)
        if holder is not None and holder != uid:
            raise DeviceBusy(f"{device.device_name} is held by claim {holder}",
                             device=device.device_name, holders=[holder])
        self._held[key] = uid
        record.devices.append(device)

    def _usable_gpu(self, gpu: Gpu) -> None:
        lost = self._session.lost_reason(gpu.uuid)
        if lost:
            raise DeviceBusy(f"GPU {gpu.index} is lost: {lost}", gpu=gpu.uuid)
        if not gpu.health.healthy:
            raise DeviceBusy(f"GPU {gpu.index} is unhealthy: {'; '.join(gpu.health.reasons)}",
                             gpu=gpu.uuid)
        reason = self._mig.quarantined(gpu.uuid)
        if reason:
            raise DeviceBusy(f"GPU {gpu.index} is quarantined: {reason}", gpu=gpu.uuid)

    def _existing(self, uid: str, request: DeviceRequest, gpus: Sequence[Gpu]) -> PreparedDevice:
        ref = request.device or ""
        gpu, device = _resolve(ref, gpus)
        self._usable_gpu(gpu)
        if device is None:
            if gpu.mig_mode is not None and gpu.mig_mode.current:
                raise DeviceBusy(f"GPU {gpu.index} has MIG enabled: claim one of its MIG devices "
                                 "or a slice, not the whole GPU", gpu=gpu.uuid)
            name = gpu_device_name(gpu.static.minor)
            return PreparedDevice(request=request.request, kind="gpu", gpu=gpu.uuid,
                                  uuid=gpu.uuid, device_name=name,
                                  cdi_device=self.cdi.qualified_name(uid, name))
        if device.gi_id in self._mig.draining(gpu.uuid):
            raise DeviceBusy(f"{device.uuid} is being drained for a MIG geometry change",
                             device=device.uuid)
        spec = next(p for p in gpu.profiles if p.name == device.profile)
        name = mig_device_name(gpu.static.minor, device.profile, spec.id, device.placement.start)
        return PreparedDevice(request=request.request, kind="mig", gpu=gpu.uuid,
                              uuid=device.uuid, gi_id=device.gi_id, ci_id=device.ci_id,
                              device_name=name, cdi_device=self.cdi.qualified_name(uid, name))

    async def _make_slice(self, uid: str, record: ClaimRecord, request: DeviceRequest,
                          gpus: Sequence[Gpu]) -> None:
        profile, gpu_ref, start = request.profile, request.gpu, request.start
        if request.device is not None:  # a dynamic ResourceSlice device name fixes all three
            parsed = parse_device_name(request.device)
            if parsed is None or parsed.profile_id is None:
                raise InvalidRequest(f"devices: {request.device!r} is not a MIG device name "
                                     "like gpu-0-mig-1g10gb-19-0",
                                     [{"field": "devices", "reason": "not a MIG device name"}])
            gpu = next((g for g in gpus if g.static.minor == parsed.minor), None)
            spec = next((p for p in gpu.profiles if p.id == parsed.profile_id
                         and profile_label(p.name) == parsed.profile), None) if gpu else None
            if gpu is None or spec is None:
                raise InvalidRequest(f"devices: no GPU or profile for {request.device!r}",
                                     [{"field": "devices", "reason": "unknown device"}])
            profile, gpu_ref, start = spec.name, gpu.uuid, parsed.start
        assert profile is not None
        candidates = [g for g in gpus if g.static.mig_capable and (
            gpu_ref is None or gpu_ref in (g.uuid, str(g.index)))]
        if gpu_ref is not None and not candidates:
            raise InvalidRequest(f"devices: no MIG-capable GPU {gpu_ref!r}",
                                 [{"field": "devices.gpu", "reason": "unknown GPU"}])
        known = {p.name for g in candidates for p in g.profiles}
        if profile not in known:
            raise InvalidRequest(f"devices: unknown MIG profile {profile!r}; known: "
                                 f"{', '.join(sorted(known))}",
                                 [{"field": "devices.profile", "reason": "unknown profile"}])
        usable = [g for g in candidates if g.mig_mode is not None and g.mig_mode.current
                  and g.health.healthy and not self._mig.quarantined(g.uuid)]
        if not usable:
            raise DeviceBusy("no healthy GPU with MIG enabled to make a slice on"
                             + (f" (GPU {gpu_ref})" if gpu_ref else "")
                             + "; enable MIG with PUT /v1/gpus/{gpu}/mig first")
        # Choose on a fresh walk without locks, then lock only the chosen GPU and check the
        # choice still holds (another slice may have landed meanwhile); retry if not. No lock
        # is held across GPUs, so slices on different GPUs are made in parallel.
        for _ in range(5):
            choice = await self._choose(profile, start, usable)
            if choice is None:
                break
            gpu, placement = choice
            mine = Instance(profile, placement)
            self._pending.setdefault(gpu.uuid, []).append(mine)
            try:
                async with self._gpu_locks.setdefault(gpu.uuid, asyncio.Lock()):
                    geometry, _ = await self._mig.current(gpu)
                    if any(i.placement.overlaps(placement) for i in geometry.instances):
                        continue  # the hardware changed under the choice: choose again
                    await self._create(uid, record, request, gpu=gpu, profile=profile,
                                       placement=placement)
                    return
            finally:
                self._pending[gpu.uuid].remove(mine)
        raise DeviceBusy(f"no room for a {profile} slice"
                         + (f" starting at memory slice {start}" if start is not None else "")
                         + " on the eligible GPUs")

    async def _choose(self, profile: str, start: int | None,
                      usable: Sequence[Gpu]) -> tuple[Gpu, Placement] | None:
        idle = [gpu for gpu in usable if self._mig.active(gpu.uuid) is None]
        walks = await asyncio.gather(*(self._mig.current(gpu) for gpu in idle))
        geometries = {gpu.uuid: walk[0] for gpu, walk in zip(idle, walks, strict=True)}
        # From here to the caller's reservation nothing awaits: the pending slices counted
        # now are exactly those reserved before this choice.
        candidates = []
        for gpu in usable:
            if gpu.uuid in geometries:
                geometry = geometries[gpu.uuid]
                # Slices reserved or recorded since the walk (another prepare may have made
                # one while this one read) count as taken too.
                taken = [*self._pending.get(gpu.uuid, ()), *self._recorded_slices(gpu.uuid)]
                extra: list[Instance] = []
                for t in taken:
                    if not any(i.placement.overlaps(t.placement)
                               for i in (*geometry.instances, *extra)):
                        extra.append(t)
                candidates.append(Candidate(gpu.index, catalog_of(gpu.profiles), Geometry(
                    mig_enabled=True, instances=(*geometry.instances, *extra))))
        choice = choose(candidates, profile, start)
        if choice is None:
            return None
        return next(g for g in usable if g.index == choice.index), choice.placement

    def _recorded_slices(self, gpu: str) -> list[Instance]:
        return [Instance(d.slice.profile, Placement(d.slice.start, d.slice.size))
                for r in self.checkpoint.data.claims.values() if r.state != "lost"
                for d in r.devices if d.slice is not None and d.slice.gpu == gpu]

    async def _create(self, uid: str, record: ClaimRecord, request: DeviceRequest, *, gpu: Gpu,
                      profile: str, placement: Placement) -> None:
        spec = next(p for p in gpu.profiles if p.name == profile)
        name = mig_device_name(gpu.static.minor, profile, spec.id, placement.start)
        device = PreparedDevice(
            request=request.request, kind="mig", gpu=gpu.uuid, device_name=name,
            cdi_device=self.cdi.qualified_name(uid, name),
            slice=SliceRecord(gpu=gpu.uuid, profile=profile, profile_id=spec.id,
                              start=placement.start, size=placement.size))
        self._reserve(uid, record, device)
        # Recorded, durably, before the GI exists: a crash from here on is rolled back at
        # start-up by destroying exactly this slice, never anything else.
        self.checkpoint.data.claims[uid] = record
        await self.checkpoint.commit()
        created = await self._session.mutate(gpu.uuid, partial(
            _create_slice, self._session, gpu.uuid, spec.id, placement))
        device.gi_id, device.ci_id, device.uuid = created
        assert device.slice is not None
        device.slice.gi_id, device.slice.ci_id = created[0], created[1]
        self._schedule_node_spec()

    @asynccontextmanager
    async def _claim_lock(self, uid: str) -> AsyncIterator[None]:
        """Hold the claim's lock; the entry goes once no call holds or waits on it, on every
        path (failed prepares and repeated unprepares too), so the map stays bounded by the
        claims in flight."""
        lock, users = self._uid_locks.get(uid, (asyncio.Lock(), 0))
        self._uid_locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._uid_locks[uid]
            if users > 1:
                self._uid_locks[uid] = (lock, users - 1)
            else:
                del self._uid_locks[uid]

    # -- unprepare -------------------------------------------------------------------------

    async def unprepare(self, uid: str) -> None:
        """Unprepare; an unknown claim is a success (unprepare may be repeated)."""
        self._usable()
        async with self._claim_lock(uid):
            record = self.checkpoint.data.claims.get(uid)
            self.checkpoint.tombstone(uid)
            if record is None:
                await self.checkpoint.commit()
                return
            if any(device.slice is not None for device in record.devices):
                # Marked durably before a slice is destroyed, so that start-up finishes the
                # job after a crash.
                record.state = "unprepare_started"
                await self.checkpoint.commit()
                await self._undo(record)
            else:
                await self._forget(record)
        self._events.append("claim.unprepared", f"claim {uid} unprepared",
                            details={"claim": uid})

    async def _forget(self, record: ClaimRecord) -> None:
        """Unprepare a claim without slices in one commit: drop it durably, then release its
        devices and remove its spec. A refused commit changes nothing; a crash after it
        leaves an orphan spec, which start-up removes."""
        del self.checkpoint.data.claims[record.uid]
        try:
            await self.checkpoint.commit()
        except BaseException:
            self.checkpoint.data.claims[record.uid] = record
            raise
        for device in record.devices:
            if self._held.get(_key(device)) == record.uid:
                del self._held[_key(device)]
        self.cdi.store.remove(self.cdi.claim_path(record.uid))  # on the loop, as it is written

    async def _undo(self, record: ClaimRecord) -> None:
        """Destroy the claim's on-demand slices, remove its spec, release its devices, drop
        it from the checkpoint (durably)."""
        for device in record.devices:
            if device.slice is not None:
                gpu = device.slice.gpu
                profiles = next((g.profiles for g in self._inventory.gpus if g.uuid == gpu), ())
                await self._session.mutate(gpu, partial(
                    _destroy_slice, self._session, gpu, profiles, device.slice))
                self._schedule_node_spec()
            if self._held.get(_key(device)) == record.uid:
                del self._held[_key(device)]
        self.cdi.store.remove(self.cdi.claim_path(record.uid))  # on the loop, as it is written
        if self.checkpoint.data.claims.get(record.uid) is record:
            del self.checkpoint.data.claims[record.uid]
        await self.checkpoint.commit()

    # -- start-up --------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Before ready: load the checkpoint, mark claims of a previous boot lost, roll back
        half-done prepares and unprepares, rebuild every spec, remove specs nobody owns."""
        try:
            previous_boot = await asyncio.to_thread(self.checkpoint.load)
        except CheckpointCorrupt as err:
            self.corrupt = err
            self._events.append("claims.checkpoint_corrupt", str(err), severity=Severity.ERROR)
            return
        gpus = {g.uuid: g for g in await self._inventory.refresh()}
        for record in list(self.checkpoint.data.claims.values()):
            if previous_boot is not None and record.state != "lost":
                record.state = "lost"
                record.lost_reason = f"the node rebooted (boot id {previous_boot} gone): " \
                                     "its devices were released"
                self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                                    severity=Severity.WARNING, details={"claim": record.uid})
            elif record.state in ("prepare_started", "unprepare_started"):
                self._events.append("claim.recovered", f"claim {record.uid} was "
                                    f"{record.state.replace('_', ' ')} when the agent stopped; "
                                    "rolled back", details={"claim": record.uid})
                await self._undo(record)
        owned: set[str] = set()
        for record in self.checkpoint.data.claims.values():
            if record.state != "prepare_completed":
                continue
            missing = [d.device_name for d in record.devices if not _present(d, gpus)]
            if missing:
                record.state = "lost"
                record.lost_reason = f"devices vanished: {', '.join(missing)}"
                self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                                    severity=Severity.WARNING, details={"claim": record.uid})
                continue
            for d in record.devices:
                self._held[_key(d)] = record.uid
            path = await asyncio.to_thread(self.cdi.write_claim, record.uid, [
                (d, gpus[d.gpu].static.minor) for d in record.devices])
            owned.add(str(path))
        for path in await asyncio.to_thread(self.cdi.claim_specs):
            if str(path) not in owned:
                await asyncio.to_thread(self.cdi.store.remove, path)
                log.info("removed a claim spec no claim owns", extra={"path": str(path)})
        await self.checkpoint.commit()
        await self.refresh_node_spec()

    async def remediate_checkpoint(self, restore: str | None) -> None:
        """An operator's answer to a corrupt checkpoint: put back a kept-aside file (``restore``,
        its name next to the checkpoint, which must now pass its check) or start from an empty
        one (``None``); then reconcile as at start-up. The kept-aside files stay."""
        if self.corrupt is None:
            raise Conflict("the claims checkpoint is not corrupt: nothing to restore or accept")
        path = self.checkpoint.path
        if restore is None:
            raw = encode(CheckpointData(boot_id=self.checkpoint.data.boot_id))
        else:
            kept = path.parent / restore
            if "/" in restore or not restore.startswith(f"{path.name}.corrupt-") \
                    or not kept.is_file():
                raise NotFound(f"no kept-aside checkpoint {restore!r} next to {path}")
            raw = await asyncio.to_thread(kept.read_bytes)
            try:
                decode(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise Conflict(f"{restore} still fails its check ({err}); repair it by hand "
                               "or accept an empty checkpoint") from err
        await asyncio.to_thread(write_atomic, path, raw, mode=0o600)
        self.corrupt = None
        how = f"restored from {restore}" if restore else "replaced by an empty one"
        self._events.append("claims.checkpoint_remediated", f"claims checkpoint {how}",
                            severity=Severity.WARNING)
        await self.reconcile()

    # -- the node-wide spec ----------------------------------------------------------------

    async def refresh_node_spec(self) -> None:
        """Rewrite the node-wide spec from a fresh inventory (one writer at a time)."""
        async with self._node_spec_lock:
            gpus = await self._inventory.refresh()
            await asyncio.to_thread(self.cdi.write_node, gpus)

    def _schedule_node_spec(self) -> None:
        """Rewrite the node-wide spec soon, coalescing bursts of changes into one write."""
        if self._node_spec_task is not None and not self._node_spec_task.done():
            self._node_spec_again = True
            return
        self._node_spec_task = asyncio.ensure_future(self._node_spec_loop())

    async def _node_spec_loop(self) -> None:
        while True:
            self._node_spec_again = False
            try:
                await self.refresh_node_spec()
            except Exception as err:  # derived state: log, and the next change retries
                log.warning("node CDI spec refresh failed", extra={"error": str(err)})
            if not self._node_spec_again:
                return

    def geometry_changed(self) -> None:
        """Called by the MIG service after a transition: the node-wide spec is stale."""
        self._schedule_node_spec()


def _present(device: PreparedDevice, gpus: Mapping[str, Gpu]) -> bool:
    gpu = gpus.get(device.gpu)
    if gpu is None:
        return False
    if device.kind == "gpu":
        return True
    return any(d.uuid == device.uuid for d in gpu.mig_devices)


def _resolve(ref: str, gpus: Sequence[Gpu]) -> tuple[Gpu, MigDevice | None]:
    """A GPU or MIG device by UUID, index, ``<gpu>:<mig>`` or ResourceSlice device name."""
    for gpu in gpus:
        if ref in (gpu.uuid, str(gpu.index)):
            return gpu, None
        for device in gpu.mig_devices:
            if ref in (device.uuid, f"{gpu.index}:{device.index}"):
                return gpu, device
    parsed = parse_device_name(ref)
    if parsed is not None:
        for gpu in gpus:
            if gpu.static.minor != parsed.minor:
                continue
            if parsed.profile is None:
                return gpu, None
            ids = {p.name: p.id for p in gpu.profiles}
            for device in gpu.mig_devices:
                if (profile_label(device.profile), ids.get(device.profile),
                        device.placement.start) == (parsed.profile, parsed.profile_id,
                                                    parsed.start):
                    return gpu, device
    raise InvalidRequest(f"devices: no device {ref!r} on this node (a GPU UUID or index, a "
                         "MIG UUID, <gpu>:<mig>, or a ResourceSlice device name)",
                         [{"field": "devices.device", "reason": "unknown device"}])


def _create_slice(session: NvmlSession, gpu: str, profile_id: int,
                  placement: Placement) -> tuple[int, int, str]:
    """Create GI + CI at the placement (NVML thread); a failed CI leaves no bare GI behind."""
    handle = session.gpu_handle(gpu)
    gi_id = mig.create_gpu_instance(session, handle, gpu, profile_id, placement)
    try:
        ci = mig.create_compute_instance(session, handle, gpu, gi_id)
    except BaseException:
        mig.destroy_gpu_instance(session, handle, gpu, gi_id)
        raise
    uuid = mig.mig_device_uuid(session, handle, gpu, gi_id, ci.id)
    if uuid is None:
        raise NotFound(f"MIG device of GI {gi_id} CI {ci.id} not enumerated on {gpu}")
    return gi_id, ci.id, uuid


def _destroy_slice(session: NvmlSession, gpu: str, profiles: Sequence[GiProfile],
                   record: SliceRecord) -> bool:
    """Destroy the recorded slice if it exists (matched by profile and placement, never by a
    GI id alone, which the driver may have reused); False when it is already gone."""
    handle = session.gpu_handle(gpu)
    current, _ = session.call("nvmlDeviceGetMigMode", handle, gpu=gpu)
    if not current:
        return False
    for gi in mig.read_instances(session, handle, gpu, profiles):
        if gi.profile_id == record.profile_id and \
                gi.placement == Placement(record.start, record.size):
            if gi.compute_instances:
                mig.destroy_compute_instances(session, handle, gpu, gi.id)
            mig.destroy_gpu_instance(session, handle, gpu, gi.id)
            return True
    return False

