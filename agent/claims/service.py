"""Preparing and unpreparing resource claims: full GPUs, existing MIG devices and MIG slices
made on demand, with CDI specs, a crash-safe checkpoint and reconciliation at start-up.

Who holds which device is the per-GPU ledger's to say (``agent/ledger/``): a claim reserves
each device there before anything durable or any NVML mutation happens, and the check and
the take never await in between, so two claims can never both get one device, however
each names it. A slice is made or destroyed under the ledger's mutation lock of its GPU, as
a one-instance transition through the MIG executor and journal. A lock per claim UID makes a
retry wait for the first attempt. No node-wide lock is held across NVML calls; checkpoint
writes are group-committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from agent.claims.cdi_writer import CdiWriter
from agent.claims.checkpoint import (
    CheckpointCorrupt,
    CheckpointData,
    ClaimCheckpoint,
    ClaimRecord,
    DeviceSharingRecord,
    PreparedDevice,
    ShareRecord,
    SliceRecord,
    decode,
    encode,
)
from agent.claims.placement import Candidate, choose
from agent.claims.sharing import MEMORY_MIB, DevicePlan, SharingConfig, SharingPlan, Target, plan
from agent.claims.sharing_runtime import SharingRuntime
from agent.device_names import (
    gpu_device_name,
    mig_device_name,
    parse_device_name,
    profile_label,
    shareable_mib,
)
from agent.durable import write_atomic
from agent.errors import (
    AgentError,
    CheckpointUnusable,
    ClaimUnprepared,
    Conflict,
    DeviceBusy,
    DeviceNodesMissing,
    DeviceUnavailable,
    InvalidRequest,
    MigNotEnabled,
    NoSliceRoom,
    NotFound,
)
from agent.events import EventLog, Severity
from agent.gpu import mig
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.types import Gpu, MigDevice, Placement
from agent.ledger.keys import DeviceKey, key_of, resolve
from agent.ledger.ledger import Hold, NodeLedger, Share
from agent.mig.catalog import catalog_of
from agent.mig.executor import GpuMutator, RestoreFailed
from agent.mig.geometry import Geometry, Instance
from agent.mig.journal import TransitionJournal
from agent.mig.slices import create_slice, destroy_slice, slice_ready

log = logging.getLogger("agent.claims")
#: Unprepared claim UIDs remembered to refuse late prepare retries: durably for claims that
#: were prepared (bounded in count; oldest dropped first), in memory only for UIDs this agent
#: never prepared, so unpreparing unknown claims costs nothing durable.
MAX_TOMBSTONES = 4096
MARKER = "claims-checkpoint.marker"


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


@dataclass(frozen=True)
class ShareHolder:
    """A claim sharing a GPU: its counted share (None: it holds the GPU whole, under MPS),
    the shareID, and the memory its MPS clients use now (None: not readable)."""

    claim: str
    memory_mib: int | None
    share_id: str | None
    used_mib: int | None
    mps_state: str | None


@dataclass(frozen=True)
class GpuShares:
    """Who shares a GPU and what is left of its shareable memory."""

    capacity_mib: int
    taken_mib: int
    holders: tuple[ShareHolder, ...]

    @property
    def left_mib(self) -> int:
        return max(0, self.capacity_mib - self.taken_mib)


class _Stale(Exception):
    """The inventory snapshot no longer matches the hardware: resolve on a fresh read."""


async def _true() -> bool:
    return True


#: Fields added after the first checkpoints: in the digest only when set, so requests
#: recorded before they existed keep their digest and their retries after an upgrade still
#: answer the same claim.
_NEWER_FIELDS = frozenset({"admin_access", "sharing", "memory_mib", "share_id"})


def _digest(requests: Sequence[DeviceRequest]) -> str:
    return hashlib.sha256(json.dumps([{k: v for k, v in asdict(r).items()
                                       if k not in _NEWER_FIELDS or v} for r in requests],
                                     sort_keys=True).encode()).hexdigest()[:32]


def _key(device: PreparedDevice) -> DeviceKey:
    """The ledger key of a recorded device: its GPU and, for a MIG device, its slices (a
    record written before placements were recorded gets its placement at load)."""
    if device.kind == "gpu":
        return DeviceKey(device.gpu)
    if device.slice is not None:
        return DeviceKey(device.gpu, Placement(device.slice.start, device.slice.size))
    assert device.placement is not None, "filled in at load"
    return DeviceKey(device.gpu, Placement(*device.placement))


def _hold(uid: str, device: PreparedDevice, profile: str | None, *,
          state: Literal["reserved", "prepared"] = "reserved") -> Hold:
    share = device.share
    shares = (Share(MEMORY_MIB, share.memory_mib),) if share is not None and share.counted \
        else ()
    return Hold(uid, _key(device), state, profile=profile, on_demand=device.slice is not None,
                admin=device.admin_access, shares=shares)


#: A recorded hold is a fact: at start-up it is put back whatever the capacity says.
_UNBOUNDED = {MEMORY_MIB: 2**62}


def _sharing_record(device: DevicePlan | None) -> DeviceSharingRecord | None:
    if device is None or device.strategy is None:
        return None
    return DeviceSharingRecord(strategy=device.strategy, interval=device.interval,
                               timeslice=device.timeslice,
                               exclusive_process=device.exclusive_process,
                               thread_percentage=device.thread_percentage,
                               pinned_mib=device.pinned_mib)


def _has_effects(record: ClaimRecord) -> bool:
    """Whether undoing the claim touches the hardware beyond its holds and spec."""
    return record.mps is not None or any(d.sharing_state is not None for d in record.devices)


class ClaimService:
    def __init__(self, *, session: NvmlSession, inventory: GpuInventory, ledger: NodeLedger,
                 journal: TransitionJournal, checkpoint: ClaimCheckpoint, cdi: CdiWriter,
                 events: EventLog, tombstone_s: float = 600.0,
                 run_dir: Path | None = None, device_node_wait_s: float = 5.0,
                 sharing: SharingRuntime | None = None, dynamic_mig: bool = False) -> None:
        self._session = session
        self._inventory = inventory
        self._ledger = ledger
        self._journal = journal
        self.checkpoint = checkpoint
        self.cdi = cdi
        self._events = events
        self._tombstone_s = tombstone_s
        self._device_node_wait_s = device_node_wait_s
        self.sharing = sharing or SharingRuntime(
            nvidia_smi=None, mps=None, mps_root=(run_dir or Path("/run/gpu-agent")) / "mps")
        self._dynamic_mig = dynamic_mig
        self._marker = run_dir / MARKER if run_dir is not None else None
        self._marked = False
        self._previous_boot: str | None = None
        # Per-UID lock and how many calls hold or wait on it; dropped when that reaches 0.
        self._uid_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._unknown_unprepared: OrderedDict[str, float] = OrderedDict()
        self._unknown_stamps: dict[str, int] = {}
        #: Why claims are frozen (corrupt or missing checkpoint), or None.
        self.corrupt: str | None = None
        self._node_spec_task: asyncio.Task[None] | None = None
        self._node_spec_lock = asyncio.Lock()
        self._node_spec_again = False
        ledger.watchers.append(lambda _gpu: self._schedule_node_spec())

    # -- reading ---------------------------------------------------------------------------

    def records(self) -> list[ClaimRecord]:
        """Every claim record, oldest first (empty while frozen: for metrics attribution)."""
        return sorted(self.checkpoint.data.claims.values(), key=lambda r: r.created_at)

    def claims(self) -> list[ClaimRecord]:
        """Every claim, oldest first; :class:`CheckpointUnusable` while claims are frozen."""
        self._usable()
        return self.records()

    def claim(self, uid: str) -> ClaimRecord:
        self._usable()
        record = self.checkpoint.data.claims.get(uid)
        if record is None:
            raise NotFound(f"no claim {uid!r} is prepared on this node", claim=uid)
        return record

    async def shares_of(self, gpu: Gpu) -> GpuShares | None:
        """The claims sharing ``gpu`` (counted shares or MPS on the whole GPU) with the
        memory each uses, or None when nobody shares it."""
        holders: list[ShareHolder] = []
        taken = 0
        for record in self.records():
            for device in record.devices:
                state = device.sharing_state
                if device.gpu != gpu.uuid or device.kind != "gpu" or (
                        device.share is None and (state is None or state.strategy != "MPS")):
                    continue
                counted = device.share is not None and device.share.counted
                used = await self.sharing.used_mib(record.mps, gpu.uuid) \
                    if record.mps is not None else None
                holders.append(ShareHolder(
                    claim=record.uid, memory_mib=device.share.memory_mib if counted and
                    device.share is not None else None,
                    share_id=device.share.share_id if device.share is not None else None,
                    used_mib=used, mps_state=record.mps.state if record.mps else None))
                taken += device.share.memory_mib if counted and device.share is not None \
                    else shareable_mib(gpu.static.memory_total_mib)
        if not holders:
            return None
        return GpuShares(capacity_mib=shareable_mib(gpu.static.memory_total_mib),
                         taken_mib=taken, holders=tuple(holders))

    def _usable(self) -> None:
        if self.corrupt is not None:
            raise CheckpointUnusable(
                f"{self.corrupt}; claims are frozen until an operator inspects it and either "
                "restores it or accepts an empty checkpoint: 'gpu-agent admin checkpoint' or "
                "POST /v1/admin/claims-checkpoint (see docs/operations.md)")

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, uid: str, requests: Sequence[DeviceRequest],
                      metadata: Mapping[str, str], *,
                      issued_at_ns: int | None = None) -> ClaimRecord:
        """Prepare a claim; a repeat with the same devices returns the same answer.

        ``issued_at_ns`` orders this prepare against the claim's unprepares (CLOCK_BOOTTIME
        of this boot, stamped by the caller when the request reached it): one stamped after
        the unprepare that left the claim's tombstone prepares it anew; one stamped at or
        before it is a late retry, refused. Without a stamp a tombstone refuses every
        prepare for the tombstone window."""
        self._usable()
        digest = _digest(requests)
        async with self._claim_lock(uid):
            record = self.checkpoint.data.claims.get(uid)
            if record is not None and record.state == "prepare_completed":
                if record.request_digest != digest:
                    raise Conflict(f"claim {uid} is already prepared with other devices; "
                                   "unprepare it first", claim=uid)
                if issued_at_ns is not None and (record.issued_at_ns is None
                                                 or issued_at_ns > record.issued_at_ns):
                    # The newest prepare this claim answered: an unprepare stamped before it
                    # is older than the caller's latest wish, and is ignored.
                    record.issued_at_ns = issued_at_ns
                    await self.checkpoint.commit()
                return record
            supersedes = self._refuse_late_retry(uid, issued_at_ns)
            if record is not None:  # half-done earlier attempt, or lost in a reboot
                await self._undo(record)
            return await self._prepare(uid, requests, metadata, digest,
                                       issued_at_ns=issued_at_ns, supersedes=supersedes)

    def _refuse_late_retry(self, uid: str, issued_at_ns: int | None) -> bool:
        """Raise :class:`ClaimUnprepared` for a late retry; True when the claim has tombstones
        that this prepare, stamped after all of them, supersedes (dropped once it is
        prepared)."""
        self.checkpoint.prune_tombstones(self._tombstone_s)
        cutoff = time.time() - self._tombstone_s
        while self._unknown_unprepared and next(iter(self._unknown_unprepared.values())) < cutoff:
            old, _ = self._unknown_unprepared.popitem(last=False)
            self._unknown_stamps.pop(old, None)
        # (unprepared at, its stamp) from the durable tombstone and the in-memory one.
        found = [(at, stamps.get(uid)) for tombstones, stamps in (
            (self.checkpoint.data.tombstones, self.checkpoint.data.tombstone_stamps),
            (self._unknown_unprepared, self._unknown_stamps)) if (at := tombstones.get(uid))
            is not None]
        if not found:
            return False
        unprepared_at = max(at for at, _ in found)
        stamps = [stamp for _, stamp in found]
        if issued_at_ns is not None and None not in stamps:
            newest = max(stamp for stamp in stamps if stamp is not None)
            if issued_at_ns > newest:
                return True
            raise ClaimUnprepared(
                f"claim {uid} was unprepared by a request stamped {newest} ns; this prepare, "
                f"stamped {issued_at_ns} ns, was issued before that: a late retry cannot "
                "bring it back", claim=uid)
        raise ClaimUnprepared(
            f"claim {uid} was unprepared {time.time() - unprepared_at:.0f} s ago; a late "
            "prepare retry cannot bring it back (a prepare stamped with issued_at_ns after "
            "a stamped unprepare can)", claim=uid)

    async def _prepare(self, uid: str, requests: Sequence[DeviceRequest],
                       metadata: Mapping[str, str], digest: str, *, issued_at_ns: int | None,
                       supersedes: bool) -> ClaimRecord:
        """Existing devices resolve against the last inventory snapshot, confirmed by one
        cheap NVML read per device while the checkpoint is written; when the snapshot is out
        of date (or for slices, which walk the GPUs anyway) against a fresh read."""
        snapshot = self._inventory.gpus
        if snapshot and not any(r.kind == "slice" for r in requests):
            try:
                return await self._prepare_on(uid, requests, metadata, digest, snapshot,
                                              confirm=True, issued_at_ns=issued_at_ns,
                                              supersedes=supersedes)
            except _Stale:
                pass
        gpus = await self._inventory.refresh()
        return await self._prepare_on(uid, requests, metadata, digest, gpus, confirm=False,
                                      issued_at_ns=issued_at_ns, supersedes=supersedes)

    async def _prepare_on(self, uid: str, requests: Sequence[DeviceRequest],
                          metadata: Mapping[str, str], digest: str, gpus: Sequence[Gpu], *,
                          confirm: bool, issued_at_ns: int | None,
                          supersedes: bool) -> ClaimRecord:
        targets = self._targets(requests, gpus, confirm=confirm)
        shared = self._sharing_plan(requests, targets)
        self.sharing.check(shared)  # 503 before anything changes
        now = time.time()
        record = ClaimRecord(uid=uid, state="prepare_started", devices=[],
                             request_digest=digest, metadata=dict(metadata),
                             created_at=now, updated_at=now, issued_at_ns=issued_at_ns)
        tombstone = self._tombstone_of(uid) if supersedes else None
        try:
            positions = [i for i, r in enumerate(requests) if r.kind == "gpu"]
            for position, (request, gpu, device) in zip(positions, targets, strict=True):
                self._reserve_existing(uid, record, request, gpu, device,
                                       shared=shared.device(position))
            for request in requests:
                if request.kind == "slice":
                    await self._make_slice(uid, record, request, gpus)
            await self._await_device_nodes(record, gpus)
            if _has_effects(record) or shared.daemon is not None:
                await self._apply_sharing(record, shared)
            record.cdi_spec = str(self.cdi.claim_path(uid))
            record.state = "prepare_completed"
            record.updated_at = time.time()
            self.checkpoint.data.claims[uid] = record
            if supersedes:  # dropped in the same commit that makes the claim durable
                self.checkpoint.drop_tombstone(uid)
                self._unknown_unprepared.pop(uid, None)
                self._unknown_stamps.pop(uid, None)
            if not await self._record(record, requests, gpus, confirm=confirm):
                raise _Stale  # recorded on a stale snapshot: undone just below
        except BaseException as failure:
            if tombstone is not None:
                self._restore_tombstone(uid, tombstone)
            await self._undo_failed(record, failure)
            raise
        self._ledger.settle(uid)
        self._events.append("claim.prepared", f"claim {uid} prepared: " + ", ".join(
            d.device_name for d in record.devices), details=_claim_details(record))
        return record

    def _sharing_plan(self, requests: Sequence[DeviceRequest],
                      targets: Sequence[tuple[DeviceRequest, Gpu, MigDevice | None]]
                      ) -> SharingPlan:
        """The claim's sharing, checked against the devices it resolved to (pure; a 422
        naming every offending field before anything is reserved)."""
        positions = [i for i, r in enumerate(requests) if r.kind == "gpu"]
        return plan([Target(
            position=position, uuid=device.uuid if device else gpu.uuid, gpu=gpu.uuid,
            kind="mig" if device else "gpu",
            memory_mib=device.memory_mib if device else gpu.static.memory_total_mib,
            mig_enabled=bool(gpu.mig_mode and gpu.mig_mode.current),
            sharing=request.sharing, memory_share_mib=request.memory_mib,
            admin_access=request.admin_access)
            for position, (request, gpu, device) in zip(positions, targets, strict=True)],
            dynamic_mig=self._dynamic_mig)

    async def _apply_sharing(self, record: ClaimRecord, shared: SharingPlan) -> None:
        """Record the claim (``prepare_started``, with its sharing intent and daemon) durably,
        then set compute modes and time slices and start its daemon: a crash from here on is
        rolled back at start-up, resetting exactly what the record says it may have set."""
        record.mps = self.sharing.daemon_record(record.uid, shared)
        self.checkpoint.data.claims[record.uid] = record
        await self.checkpoint.commit()
        await self.sharing.apply(record)

    def _still_needed(self, record: ClaimRecord) -> Callable[[str, str], bool]:
        """Whether a claim other than ``record`` still needs a GPU's sharing setting."""
        def needed(gpu: str, what: str) -> bool:
            for other in self.checkpoint.data.claims.values():
                if other.uid == record.uid or other.state == "lost":
                    continue
                for device in other.devices:
                    sharing = device.sharing_state
                    if device.gpu == gpu and sharing is not None and (
                            (what == "timeslice" and sharing.timeslice is not None) or
                            (what == "exclusive_process" and sharing.exclusive_process)):
                        return True
            return False
        return needed

    async def _undo_failed(self, record: ClaimRecord, failure: BaseException) -> None:
        """Undo a prepare that failed. When its sharing cannot be undone (a daemon that
        will not stop, nvidia-smi failing), the claim stays recorded (``prepare_started``,
        with why) and keeps its holds, so no other claim gets a GPU in an unknown state;
        start-up, a retry or an unprepare tries again."""
        try:
            await self._undo(record)
        except AgentError as err:
            if not any(h.holder == record.uid for h in self._ledger.holds()):
                # Everything was undone and released; only the final checkpoint write failed
                # (a full disk): the claim stays dropped in memory, and a record left on disk
                # (prepare_started) is rolled back at start-up.
                log.warning("claim undone but not yet durably dropped", extra={
                    "claim": record.uid, "error": err.detail})
                return
            record.lost_reason = f"could not be cleaned up: {err.detail}"
            record.updated_at = time.time()
            self.checkpoint.data.claims[record.uid] = record
            with contextlib.suppress(Exception):
                await self.checkpoint.commit()
            self._events.append("claim.cleanup_failed", f"claim {record.uid}: "
                                f"{record.lost_reason} (after: {failure})",
                                severity=Severity.ERROR, details=_claim_details(record))

    def _tombstone_of(self, uid: str) -> tuple[tuple[float, int] | None, tuple[float, int] | None]:
        """The claim's durable and in-memory tombstones (time, stamp), to put back when a
        prepare that superseded them fails."""
        data = self.checkpoint.data
        durable = (data.tombstones[uid], data.tombstone_stamps[uid]) \
            if uid in data.tombstones and uid in data.tombstone_stamps else None
        memory = (self._unknown_unprepared[uid], self._unknown_stamps[uid]) \
            if uid in self._unknown_unprepared and uid in self._unknown_stamps else None
        return durable, memory

    def _restore_tombstone(self, uid: str, tombstone: tuple[tuple[float, int] | None,
                                                              tuple[float, int] | None]) -> None:
        durable, memory = tombstone
        data = self.checkpoint.data
        if durable is not None and uid not in data.tombstones:
            data.tombstones[uid], data.tombstone_stamps[uid] = durable
        if memory is not None and uid not in self._unknown_unprepared:
            self._unknown_unprepared[uid], self._unknown_stamps[uid] = memory

    async def _await_device_nodes(self, record: ClaimRecord, gpus: Sequence[Gpu]) -> None:
        """Return once every device node the claim's spec will name exists (the driver makes
        ``/dev/nvidia*`` late on a freshly booted node); after the configured wait, raise
        :class:`DeviceNodesMissing` (the caller then undoes everything reserved or made)."""
        minors = {g.uuid: g.static.minor for g in gpus}
        paths = self.cdi.device_nodes([(d, minors[d.gpu]) for d in record.devices])
        missing = self.cdi.missing_nodes(paths)  # a few stats: on the loop, as the spec is
        if not missing:
            return
        deadline = time.monotonic() + self._device_node_wait_s
        while missing and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            missing = self.cdi.missing_nodes(missing)
        if missing:
            raise DeviceNodesMissing(
                f"claim {record.uid}: device node(s) {', '.join(missing)} do not exist under "
                f"{self.cdi.dev_root} after {self._device_node_wait_s:g} s (is the NVIDIA "
                "driver still loading?); nothing was prepared, retry later",
                claim=record.uid, missing=missing)

    def _targets(self, requests: Sequence[DeviceRequest], gpus: Sequence[Gpu], *,
                 confirm: bool) -> list[tuple[DeviceRequest, Gpu, MigDevice | None]]:
        """The existing devices the claim names, each once: the same device (or a GPU and
        one of its MIG devices) named twice is refused, naming both entries."""
        targets: list[tuple[DeviceRequest, Gpu, MigDevice | None]] = []
        seen: list[tuple[int, DeviceKey]] = []
        for position, request in enumerate(requests):
            if request.kind != "gpu":
                continue
            try:
                gpu, device = resolve(request.device or "", gpus)
            except InvalidRequest:
                if confirm:  # maybe made since the snapshot
                    raise _Stale from None
                raise
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
            targets.append((request, gpu, device))
        return targets

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
            self.cdi.write_claim(record.uid, [(d, minors[d.gpu]) for d in record.devices],
                                 mps_root=_mps_root(record))
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
            targets = [resolve(request.device or "", gpus) for request in requests]
        except InvalidRequest:
            return False
        return all(mig.still_there(self._session, gpu, device) for gpu, device in targets)

    def _reserve_existing(self, uid: str, record: ClaimRecord, request: DeviceRequest,
                          gpu: Gpu, device: MigDevice | None, *,
                          shared: DevicePlan | None = None) -> None:
        """Check the device can be handed out and reserve it in the ledger (no await)."""
        self._ledger.check_usable(gpu, device)
        if device is None:
            if gpu.mig_mode is not None and gpu.mig_mode.current:
                raise DeviceBusy(f"GPU {gpu.index} has MIG enabled: claim one of its MIG devices "
                                 "or a slice, not the whole GPU", gpu=gpu.uuid)
            busy = self._ledger.busy(gpu.uuid)
            if busy is not None and not request.admin_access:  # an admin hold blocks nothing
                raise DeviceBusy(f"GPU {gpu.index} is busy with MIG transition {busy}",
                                 gpu=gpu.uuid, transition=busy)
            name = gpu_device_name(gpu.static.minor)
            prepared = PreparedDevice(request=request.request, kind="gpu", gpu=gpu.uuid,
                                      uuid=gpu.uuid, device_name=name,
                                      cdi_device=self.cdi.qualified_name(uid, name),
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
                cdi_device=self.cdi.qualified_name(uid, name), admin_access=request.admin_access)
            profile = device.profile
        prepared.sharing_state = _sharing_record(shared)
        capacity = None
        if request.memory_mib is not None or request.share_id is not None:
            # A shareID without a capacity (a result that consumed none) is a share of the
            # whole device: held exclusively, its ID echoed.
            counted = shared is not None and shared.share_mib is not None
            memory = request.memory_mib if request.memory_mib is not None else \
                device.memory_mib if device is not None else \
                shareable_mib(gpu.static.memory_total_mib)
            prepared.share = ShareRecord(memory_mib=memory, share_id=request.share_id,
                                         counted=counted)
            if counted:
                assert shared is not None and shared.shareable_mib is not None
                capacity = {MEMORY_MIB: shared.shareable_mib}
        self._ledger.take(_hold(uid, prepared, profile), name=f"GPU {gpu.index} ({name})"
                          if capacity else name, capacity=capacity)
        record.devices.append(prepared)

    async def _make_slice(self, uid: str, record: ClaimRecord, request: DeviceRequest,
                          gpus: Sequence[Gpu]) -> None:
        profile, gpu_ref, start = request.profile, request.gpu, request.start
        if request.admin_access:  # a slice made for a monitor would be a device nobody else has
            raise InvalidRequest("devices: admin_access is for existing devices, not slices made "
                                 "on demand", [{"field": "devices.admin_access",
                                                "reason": "only with kind 'gpu'"}])
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
        if gpu_ref is not None:
            self._ledger.check_usable(candidates[0])  # a pinned GPU says why it cannot serve
        # A device the scheduler allocated from --dynamic-mig slices may switch MIG on.
        ready = [g for g in candidates if slice_ready(g, allocated=request.device is not None)]
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
        # Choose on a fresh walk, reserve the choice in the ledger (counted by every later
        # choice, so concurrent prepares spread over free placements), then make it under
        # the GPU's mutation lock after checking it still holds; retry if not. No lock is
        # held across GPUs, so slices on different GPUs are made in parallel.
        for _ in range(5):
            choice = await self._choose(profile, start, usable)
            if choice is None:
                break
            gpu, placement = choice
            spec = next(p for p in gpu.profiles if p.name == profile)
            name = mig_device_name(gpu.static.minor, profile, spec.id, placement.start)
            device = PreparedDevice(
                request=request.request, kind="mig", gpu=gpu.uuid, device_name=name,
                cdi_device=self.cdi.qualified_name(uid, name),
                slice=SliceRecord(gpu=gpu.uuid, profile=profile, profile_id=spec.id,
                                  start=placement.start, size=placement.size))
            try:
                self._ledger.take(_hold(uid, device, profile), name=name)
            except DeviceBusy:
                continue  # reserved by another prepare since the choice: choose again
            try:
                async with self._ledger.slice_change(gpu.uuid):
                    geometry = await self._walk(gpu)
                    if any(i.placement.overlaps(placement) for i in geometry.instances):
                        self._ledger.release(uid, _key(device))
                        continue  # the hardware changed under the choice: choose again
                    await self._create(record, device, gpu, geometry)
                    return
            except DeviceBusy:  # a transition took the GPU meanwhile
                if device not in record.devices:
                    self._ledger.release(uid, _key(device))
                if gpu_ref is not None:
                    raise
        busy = [self._ledger.busy(g.uuid) for g in usable]
        if gpu_ref is not None and busy[0] is not None:
            raise DeviceBusy(f"GPU {usable[0].index} is busy with MIG transition {busy[0]}",
                             gpu=usable[0].uuid, transition=busy[0])
        raise _no_room(profile, start, usable, mig_off, pinned=gpu_ref is not None)

    async def _walk(self, gpu: Gpu) -> Geometry:
        """The GPU's geometry from a fresh NVML walk (read pool)."""
        return await self._session.read(GpuMutator(self._session, gpu.uuid,
                                                   gpu.profiles).geometry)

    async def _choose(self, profile: str, start: int | None,
                      usable: Sequence[Gpu]) -> tuple[Gpu, Placement] | None:
        idle = [gpu for gpu in usable if self._ledger.busy(gpu.uuid) is None]
        walks = await asyncio.gather(*(self._walk(gpu) for gpu in idle))
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

    async def _create(self, record: ClaimRecord, device: PreparedDevice, gpu: Gpu,
                      current: Geometry) -> None:
        """Make the reserved slice. Recorded, durably, before the GI exists: a crash from
        here on is rolled back at start-up (the journal, then this record), destroying
        exactly this slice, never anything else."""
        assert device.slice is not None
        record.devices.append(device)
        self.checkpoint.data.claims[record.uid] = record
        await self.checkpoint.commit()
        mutator = GpuMutator(self._session, gpu.uuid, gpu.profiles)
        made = device.slice
        try:
            created = await self._session.mutate(gpu.uuid, partial(
                create_slice, mutator, self._journal, current, made.profile,
                profile_id=made.profile_id, placement=Placement(made.start, made.size)))
        except RestoreFailed as err:
            reason = (f"making slice {device.device_name} for claim {record.uid} failed and "
                      f"could not be undone: {err}")
            await self._quarantine(gpu, reason)
            raise DeviceUnavailable(f"GPU {gpu.index} is quarantined: {reason}", gpu=gpu.uuid,
                                    reason=reason) from err
        device.gi_id, device.ci_id, device.uuid = created
        device.slice.gi_id, device.slice.ci_id = created[0], created[1]

    async def _quarantine(self, gpu: Gpu, reason: str) -> None:
        await self._ledger.quarantine(gpu.uuid, reason, durable_best_effort=True)
        self._events.append("mig.quarantined", f"GPU {gpu.index} quarantined: {reason}",
                            severity=Severity.ERROR, gpu=gpu.uuid)

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

    async def unprepare(self, uid: str, *, issued_at_ns: int | None = None) -> None:
        """Unprepare; an unknown claim is a success (unprepare may be repeated). One stamped
        (``issued_at_ns``) before the newest stamped prepare the claim answered is a late
        one and changes nothing."""
        self._usable()
        async with self._claim_lock(uid):
            record = self.checkpoint.data.claims.get(uid)
            if record is None:
                # Never prepared here (or already gone): nothing durable, but a late prepare
                # retry is still refused for the tombstone window.
                self._unknown_unprepared.pop(uid, None)
                self._unknown_unprepared[uid] = time.time()
                if issued_at_ns is None:
                    self._unknown_stamps.pop(uid, None)
                else:
                    self._unknown_stamps[uid] = max(issued_at_ns,
                                                    self._unknown_stamps.get(uid, issued_at_ns))
                while len(self._unknown_unprepared) > MAX_TOMBSTONES:
                    old, _ = self._unknown_unprepared.popitem(last=False)
                    self._unknown_stamps.pop(old, None)
                return
            if issued_at_ns is not None and record.issued_at_ns is not None \
                    and issued_at_ns < record.issued_at_ns:
                log.info("late unprepare ignored", extra={
                    "claim": uid, "issued_at_ns": issued_at_ns,
                    "prepared_at_ns": record.issued_at_ns})
                return
            self.checkpoint.tombstone(uid, issued_at_ns)
            self.checkpoint.cap_tombstones(MAX_TOMBSTONES)
            if any(device.slice is not None for device in record.devices) or \
                    _has_effects(record):
                # Marked durably before a slice is destroyed or a daemon stopped, so that
                # start-up finishes the job after a crash.
                record.state = "unprepare_started"
                await self.checkpoint.commit()
                await self._undo(record)
            else:
                await self._forget(record)
        self._events.append("claim.unprepared", f"claim {uid} unprepared",
                            details=_claim_details(record))

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
        self._ledger.release(record.uid)
        self.cdi.store.remove(self.cdi.claim_path(record.uid))  # on the loop, as it is written

    async def _undo(self, record: ClaimRecord) -> None:
        """Destroy the claim's on-demand slices, remove its spec, release its devices, drop
        it from the checkpoint (durably). Its holds keep others off the devices until then,
        but no longer stand in the way of a transition destroying them."""
        self._ledger.settle(record.uid, "releasing")
        if _has_effects(record):
            # Before the holds go: a GPU is handed on only once its daemon is stopped and its
            # compute mode and time slice are back (an error here keeps the holds).
            await self.sharing.undo(record, self._still_needed(record))
        for device in record.devices:
            if device.slice is not None:
                gpu = device.slice.gpu
                profiles = next((g.profiles for g in self._inventory.gpus if g.uuid == gpu), ())
                mutator = GpuMutator(self._session, gpu, profiles)
                async with self._ledger.slice_change(gpu, wait=True):
                    await self._session.mutate(gpu, partial(
                        destroy_slice, mutator, self._journal, device.slice.profile,
                        profile_id=device.slice.profile_id,
                        placement=Placement(device.slice.start, device.slice.size)))
        self._ledger.release(record.uid)
        self.cdi.store.remove(self.cdi.claim_path(record.uid))  # on the loop, as it is written
        if self.checkpoint.data.claims.get(record.uid) is record:
            del self.checkpoint.data.claims[record.uid]
        await self.checkpoint.commit()

    # -- start-up --------------------------------------------------------------------------

    async def load(self) -> None:
        """Before journal recovery: read the checkpoint and put the holds of prepared claims
        in the ledger, so a rollback at start-up keeps their instances. A corrupt checkpoint,
        or a missing one where the node shows evidence of claims, freezes claims (and the
        geometry changes that could destroy what they hold) until an operator acts."""
        existed = await asyncio.to_thread(self.checkpoint.path.exists)
        try:
            previous_boot = await asyncio.to_thread(self.checkpoint.load)
        except CheckpointCorrupt as err:
            self._freeze(str(err))
            return
        if not existed:
            evidence = await asyncio.to_thread(self._evidence)
            if evidence:
                self._freeze(f"claims checkpoint {self.checkpoint.path} is missing, but "
                             f"{evidence}: prepared claims may hold devices nobody can name")
                return
        self._previous_boot = previous_boot
        if previous_boot is not None:
            return  # every claim of the previous boot is lost (reconcile marks them)
        gpus = {g.uuid: g for g in self._inventory.gpus}
        for record in self.checkpoint.data.claims.values():
            # A half-done claim's shared GPUs stay held until reconcile has reset them.
            half_done = record.state in ("prepare_started", "unprepare_started")
            if record.state != "prepare_completed" and not half_done:
                continue
            for device in record.devices:
                if half_done and device.sharing_state is None and device.share is None:
                    continue
                gpu = gpus.get(device.gpu)
                mig = next((d for d in gpu.mig_devices if d.uuid == device.uuid), None) \
                    if gpu is not None and device.kind == "mig" else None
                if device.kind == "mig" and device.slice is None and device.placement is None:
                    if mig is None:
                        continue  # vanished: reconcile marks the claim lost
                    device.placement = (mig.placement.start, mig.placement.size)
                profile = device.slice.profile if device.slice else mig.profile if mig else None
                self._ledger.take(_hold(record.uid, device, profile, state="prepared"),
                                  name=device.device_name, capacity=_UNBOUNDED)

    def _evidence(self) -> str | None:
        """What shows claims were prepared on this boot though the checkpoint is gone: claim
        CDI specs, or the run directory's marker of a checkpoint written on this boot."""
        specs = self.cdi.claim_specs()
        if specs:
            return f"{len(specs)} claim CDI spec(s) are in {self.cdi.store.directory}"
        if self._marker is not None:
            try:
                marker = json.loads(self._marker.read_bytes())
            except (OSError, ValueError):
                return None
            if isinstance(marker, dict) and marker.get("boot_id") == \
                    self.checkpoint.data.boot_id and \
                    marker.get("checkpoint") == str(self.checkpoint.path):
                return f"{self._marker} says a checkpoint was written on this boot"
        return None

    def _freeze(self, reason: str) -> None:
        self.corrupt = reason
        self._ledger.frozen = f"claims are frozen ({reason})"
        self._events.append("claims.checkpoint_corrupt", reason, severity=Severity.ERROR)

    async def reconcile(self) -> None:
        """Before ready: mark claims of a previous boot lost, roll back half-done prepares
        and unprepares, rebuild every spec, remove specs nobody owns. A claim that cannot be
        cleaned up (its GPU is lost) keeps its record and state, and the node still becomes
        ready."""
        if self.corrupt is not None:
            return
        gpus = {g.uuid: g for g in await self._inventory.refresh()}
        for record in list(self.checkpoint.data.claims.values()):
            if self._previous_boot is not None and record.state != "lost":
                record.state = "lost"
                record.lost_reason = f"the node rebooted (boot id {self._previous_boot} " \
                                     "gone): its devices were released"
                self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                                    severity=Severity.WARNING, details=_claim_details(record))
            elif record.state in ("prepare_started", "unprepare_started"):
                self._events.append("claim.recovered", f"claim {record.uid} was "
                                    f"{record.state.replace('_', ' ')} when the agent stopped; "
                                    "rolled back", details=_claim_details(record))
                try:
                    await self._undo(record)
                except AgentError as err:
                    record.lost_reason = f"could not be cleaned up: {err.detail}"
                    self._events.append("claim.cleanup_failed", f"claim {record.uid}: "
                                        f"{record.lost_reason}", severity=Severity.ERROR,
                                        details=_claim_details(record))
        owned: set[str] = set()
        for record in self.checkpoint.data.claims.values():
            if record.state != "prepare_completed":
                if record.state == "lost" or record.lost_reason:
                    owned.add(str(self.cdi.claim_path(record.uid)))
                continue
            missing = [d.device_name for d in record.devices if not _present(d, gpus)]
            lost = [d.device_name for d in record.devices
                    if self._session.lost_reason(d.gpu) is not None]
            if missing or lost:
                record.state = "lost"
                record.lost_reason = (f"its GPU is lost: {', '.join(lost)}" if lost
                                      else f"devices vanished: {', '.join(missing)}")
                self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                                    severity=Severity.WARNING, details=_claim_details(record))
                if not lost:  # a lost GPU's devices stay held: nobody else may get them
                    self._ledger.release(record.uid)
                continue
            path = await asyncio.to_thread(partial(
                self.cdi.write_claim, record.uid,
                [(d, gpus[d.gpu].static.minor) for d in record.devices],
                mps_root=_mps_root(record)))
            owned.add(str(path))
            await self._reapply_sharing(record)
            if record.mps is not None:
                await self._adopt_daemon(record)
        for path in await asyncio.to_thread(self.cdi.claim_specs):
            if str(path) not in owned:
                await asyncio.to_thread(self.cdi.store.remove, path)
                log.info("removed a claim spec no claim owns", extra={"path": str(path)})
        self._previous_boot = None
        await self.checkpoint.commit()
        await self._mark_boot()
        await self.refresh_node_spec()

    async def _reapply_sharing(self, record: ClaimRecord) -> None:
        """At start-up: a prepared claim's compute mode and time slice are set again (a GPU
        reset while the agent was down would have put back the defaults); a failure is
        reported and the claim kept (its holds keep the GPU from anyone else)."""
        try:
            await self.sharing.reapply(record)
        except AgentError as err:
            self._events.append("claim.sharing_not_reapplied", f"claim {record.uid}: its "
                                f"sharing settings could not be set again: {err.detail}",
                                severity=Severity.ERROR, details=_claim_details(record))

    async def _adopt_daemon(self, record: ClaimRecord) -> None:
        """At start-up: a prepared claim's daemon that still answers is adopted as it runs
        (its clients keep their contexts); one that does not is reported failed, and the
        claim keeps its holds until it is unprepared (nothing else gets the GPU before its
        compute mode is reset)."""
        assert record.mps is not None
        if await self.sharing.alive(record.mps):
            if record.mps.state != "running":
                record.mps.state, record.mps.reason = "running", None
            self._events.append("claim.mps_adopted", f"claim {record.uid}: MPS control daemon "
                                f"at {record.mps.root} still runs; adopted",
                                details=_claim_details(record))
        elif record.mps.state != "failed":
            self._daemon_failed(record, "its MPS control daemon was not running when the "
                                "agent started")

    def _daemon_failed(self, record: ClaimRecord, reason: str) -> None:
        assert record.mps is not None
        record.mps.state, record.mps.reason = "failed", reason
        record.updated_at = time.time()
        self._events.append("claim.mps_failed", f"claim {record.uid}: {reason} "
                            f"({record.mps.root}); its pods' CUDA clients have lost MPS; "
                            "unprepare the claim to free its GPUs", severity=Severity.ERROR,
                            details=_claim_details(record))

    async def check_daemons(self) -> int:
        """Report every prepared claim whose MPS daemon stopped answering (event, claim
        ``mps.state`` failed, durably); returns how many were found dead."""
        if self.corrupt is not None:
            return 0
        dead = 0
        running = [r for r in self.checkpoint.data.claims.values()
                   if r.state == "prepare_completed" and r.mps is not None
                   and r.mps.state == "running"]
        # All at once: each check is a short nvidia-cuda-mps-control run.
        answers = await asyncio.gather(*(self.sharing.alive(r.mps) for r in running if r.mps))
        for record, alive in zip(running, answers, strict=True):
            if alive or record.mps is None:
                continue
            async with self._claim_lock(record.uid):
                if self.checkpoint.data.claims.get(record.uid) is not record \
                        or record.state != "prepare_completed" or record.mps.state != "running":
                    continue  # unprepared (or re-checked) meanwhile
                if await self.sharing.alive(record.mps):
                    continue
                self._daemon_failed(record, "its MPS control daemon stopped answering")
                await self.checkpoint.commit()
                dead += 1
        return dead

    async def supervise_daemons(self, interval_s: float) -> None:
        """Check the claims' MPS daemons every ``interval_s`` (a task of the node)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_daemons()
            except (AgentError, OSError) as err:
                log.warning("MPS daemon check failed", extra={"error": str(err)})

    async def _mark_boot(self) -> None:
        """Note, outside the state directory, that this boot has a checkpoint: if the state
        directory is deleted, the next start on this boot knows claims may exist."""
        if self._marker is None or self._marked:
            return
        body = json.dumps({"boot_id": self.checkpoint.data.boot_id,
                           "checkpoint": str(self.checkpoint.path)}).encode()
        try:
            await asyncio.to_thread(write_atomic, self._marker, body, mode=0o600)
            self._marked = True
        except OSError as err:
            log.warning("run-directory marker not written", extra={"error": str(err)})

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
            # Any file of this checkpoint beside it: one it kept aside, or an operator's
            # repaired copy or backup (claims.checkpoint.backup); never a temp file.
            if "/" in restore or not restore.startswith(f"{path.name}.") \
                    or ".tmp." in restore or not kept.is_file():
                raise NotFound(f"no kept-aside checkpoint {restore!r} next to {path} (a file "
                               f"named {path.name}.* there)")
            raw = await asyncio.to_thread(kept.read_bytes)
            try:
                decode(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise Conflict(f"{restore} still fails its check ({err}); repair it by hand "
                               "or accept an empty checkpoint") from err
        await asyncio.to_thread(write_atomic, path, raw, mode=0o600)
        self.corrupt = None
        self._ledger.frozen = None
        how = f"restored from {restore}" if restore else "replaced by an empty one"
        self._events.append("claims.checkpoint_remediated", f"claims checkpoint {how}",
                            severity=Severity.WARNING)
        await self.load()
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
                await self._lose_destroyed_admin_claims()
            except Exception as err:  # derived state: log, and the next change retries
                log.warning("node CDI spec refresh failed", extra={"error": str(err)})
            if not self._node_spec_again:
                return

    async def _lose_destroyed_admin_claims(self) -> None:
        """After a geometry change (on the inventory just refreshed): a claim whose admin-held
        MIG device a transition destroyed (admin holds do not block one) is lost, its holds
        released and its spec removed, so no container is started on a device that is gone."""
        if self.corrupt is not None:
            return
        gpus = {g.uuid: g for g in self._inventory.gpus}
        for record in list(self.checkpoint.data.claims.values()):
            if record.state != "prepare_completed" or \
                    not any(d.admin_access and not _present(d, gpus) for d in record.devices):
                continue
            async with self._claim_lock(record.uid):
                if self.checkpoint.data.claims.get(record.uid) is not record or \
                        record.state != "prepare_completed":
                    continue  # unprepared meanwhile
                # Confirmed on a fresh read: the claim may have been prepared on a device
                # made after the snapshot this started from.
                gpus = {g.uuid: g for g in await self._inventory.refresh()}
                gone = [d.device_name for d in record.devices if not _present(d, gpus)]
                if not any(d.admin_access and not _present(d, gpus) for d in record.devices):
                    continue
                record.state = "lost"
                record.lost_reason = ("a MIG geometry change destroyed its admin-access "
                                      f"device(s): {', '.join(gone)}")
                record.updated_at = time.time()
                self._ledger.release(record.uid)
                self.cdi.store.remove(self.cdi.claim_path(record.uid))
                await self.checkpoint.commit()
            self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                                severity=Severity.WARNING, details=_claim_details(record))


def _mps_root(record: ClaimRecord) -> Path | None:
    return Path(record.mps.root) if record.mps is not None else None


def _present(device: PreparedDevice, gpus: Mapping[str, Gpu]) -> bool:
    gpu = gpus.get(device.gpu)
    if gpu is None:
        return False
    if device.kind == "gpu":
        return True
    return any(d.uuid == device.uuid for d in gpu.mig_devices)


def _claim_details(record: ClaimRecord) -> dict[str, object]:
    """An event's details for a claim: its uid and the GPUs (UUIDs) it holds, so the event's
    log line names them."""
    return {"claim": record.uid, "gpus": sorted({d.gpu for d in record.devices})}


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
