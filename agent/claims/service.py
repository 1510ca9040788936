"""Preparing and unpreparing resource claims: full GPUs, existing MIG devices and MIG slices
made on demand, with CDI specs and a crash-safe checkpoint.

Who holds which device is the per-GPU ledger's to say (``agent/ledger/``): a claim reserves
each device there before anything durable or any NVML mutation happens, and the check and
the take never await in between, so two claims can never both get one device, however each
names it. A slice is made or destroyed through the one door to the MIG instances
(:class:`agent.mig.devices.MigDevices`), as a one-instance transition. A lock per claim UID
makes a retry wait for the first attempt. No node-wide lock is held across NVML calls;
checkpoint writes are group-committed.

The rest of a claim's life has a module each: late retries (:mod:`.tombstones`), start-up
and remediation (:mod:`.recovery`), MPS daemons (:mod:`.daemons`), the node-wide spec
(:mod:`.node_spec`); :class:`ClaimService` is what the rest of the agent asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.claims import existing
from agent.claims.cdi_writer import CdiWriter
from agent.claims.channels import CHANNEL, CHANNEL_NAME, Channels, channel_specs
from agent.claims.checkpoint import ClaimCheckpoint, ClaimRecord, ImexChannelRecord
from agent.claims.daemons import DaemonSupervisor
from agent.claims.locks import ClaimLocks
from agent.claims.node_spec import NodeSpec
from agent.claims.records import claim_details, has_effects, mps_roots
from agent.claims.recovery import ClaimRecovery
from agent.claims.requests import DeviceNames, DeviceRequest, digest, resourceslice_name_errors
from agent.claims.sharing import SharingPlan, Target, plan
from agent.claims.sharing_runtime import SharingRuntime
from agent.claims.slices import ClaimSlices, check_slices, gpus_for
from agent.claims.tombstones import Tombstones
from agent.device_names import shareable_mib
from agent.errors import (
    AgentError,
    Conflict,
    DeviceNodesMissing,
    ImexChannelMissing,
    ImexNotConfigured,
    InvalidRequest,
    NotFound,
)
from agent.events import EventLog, Severity
from agent.gpu.inventory import GpuInventory
from agent.gpu.types import Gpu
from agent.ledger.ledger import NodeLedger
from agent.mig.devices import MigDevices
from cdi.nvidia import HostFactsError

__all__ = ["ClaimService", "GpuShares", "ShareHolder"]

log = logging.getLogger("agent.claims")


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


class ClaimService:
    def __init__(self, *, inventory: GpuInventory, ledger: NodeLedger, devices: MigDevices,
                 checkpoint: ClaimCheckpoint, cdi: CdiWriter, events: EventLog,
                 tombstone_s: float = 600.0, run_dir: Path | None = None,
                 device_node_wait_s: float = 5.0, sharing: SharingRuntime | None = None,
                 dynamic_mig: bool = False, channels: Channels | None = None) -> None:
        self._inventory = inventory
        self._channels = channels
        self._ledger = ledger
        self.checkpoint = checkpoint
        self.cdi = cdi
        self._events = events
        self._device_node_wait_s = device_node_wait_s
        self.sharing = sharing or SharingRuntime(
            nvidia_smi=None, mps=None, mps_root=(run_dir or Path("/run/gpu-agent")) / "mps")
        self._dynamic_mig = dynamic_mig
        self.locks = ClaimLocks()
        self._tombstones = Tombstones(checkpoint, tombstone_s)
        self._slices = ClaimSlices(ledger=ledger, devices=devices, checkpoint=checkpoint,
                                   cdi=cdi)
        self.daemons = DaemonSupervisor(checkpoint=checkpoint, sharing=self.sharing,
                                        locks=self.locks, events=events)
        self.recovery = ClaimRecovery(
            checkpoint=checkpoint, ledger=ledger, inventory=inventory, cdi=cdi, events=events,
            sharing=self.sharing, daemons=self.daemons, locks=self.locks, undo=self._undo,
            refresh_node_spec=self._refresh_node_spec, run_dir=run_dir, channels=channels)
        self.node_spec = NodeSpec(inventory=inventory, cdi=cdi,
                                  after=self.recovery.lose_destroyed_admin_claims)
        ledger.watchers.append(self.node_spec.schedule)

    # -- reading ---------------------------------------------------------------------------

    @property
    def corrupt(self) -> str | None:
        """Why claims are frozen (corrupt or missing checkpoint), or None."""
        return self.recovery.corrupt

    def records(self) -> list[ClaimRecord]:
        """Every claim record, oldest first (empty while frozen: for metrics attribution)."""
        return sorted(self.checkpoint.data.claims.values(), key=lambda r: r.created_at)

    def claims(self) -> list[ClaimRecord]:
        """Every claim, oldest first; :class:`CheckpointUnusable` while claims are frozen."""
        self.recovery.check_usable()
        return self.records()

    def claim(self, uid: str) -> ClaimRecord:
        self.recovery.check_usable()
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
                daemon = next((m for m in record.daemons() if device.uuid in m.devices
                               or gpu.uuid in m.devices), None)
                used = await self.sharing.used_mib(daemon, gpu.uuid) \
                    if daemon is not None else None
                holders.append(ShareHolder(
                    claim=record.uid, memory_mib=device.share.memory_mib if counted and
                    device.share is not None else None,
                    share_id=device.share.share_id if device.share is not None else None,
                    used_mib=used, mps_state=daemon.state if daemon else None))
                taken += device.share.memory_mib if counted and device.share is not None \
                    else shareable_mib(gpu.static.memory_total_mib)
        if not holders:
            return None
        return GpuShares(capacity_mib=shareable_mib(gpu.static.memory_total_mib),
                         taken_mib=taken, holders=tuple(holders))

    # -- the rest of a claim's life, for the node and the API ------------------------------

    async def load(self) -> None:
        """Before journal recovery: the checkpoint read and its holds put in the ledger."""
        await self.recovery.load()

    async def reconcile(self) -> None:
        """Before ready: lost and half-done claims resolved, specs rebuilt."""
        await self.recovery.reconcile()

    async def remediate_checkpoint(self, restore: str | None) -> None:
        """An operator's answer to a corrupt checkpoint (restore a kept-aside file, or accept
        an empty one), then reconciliation as at start-up."""
        await self.recovery.remediate(restore)

    async def check_daemons(self) -> int:
        """Report every prepared claim whose MPS daemon stopped answering; how many."""
        return 0 if self.corrupt is not None else await self.daemons.check()

    async def supervise_daemons(self, interval_s: float) -> None:
        """Check the claims' MPS daemons every ``interval_s`` (a task of the node)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_daemons()
            except (AgentError, OSError) as err:
                log.warning("MPS daemon check failed", extra={"error": str(err)})

    async def _refresh_node_spec(self) -> None:
        await self.node_spec.refresh()

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, uid: str, requests: Sequence[DeviceRequest],
                      metadata: Mapping[str, str], *, issued_at_ns: int | None = None,
                      device_names: DeviceNames = "any") -> ClaimRecord:
        """Prepare a claim; a repeat with the same devices returns the same answer.

        Every device the claim names is checked against the node before anything is held: a
        name of no device here is a 422 naming its entry, and with ``device_names=
        "resourceslice"`` so is any name but a ResourceSlice device name (the kubelet
        plugin's: the answer then names each device as the allocation did).

        ``issued_at_ns`` orders this prepare against the claim's unprepares (CLOCK_BOOTTIME
        of this boot, stamped by the caller when the request reached it): one stamped after
        the unprepare that left the claim's tombstone prepares it anew; one stamped at or
        before it is a late retry, refused. Without a stamp a tombstone refuses every
        prepare for the tombstone window."""
        self.recovery.check_usable()
        if device_names == "resourceslice" and (errors := resourceslice_name_errors(requests)):
            raise InvalidRequest(
                "; ".join(f"{e['field']}: {e['device']!r} is {e['reason']}" for e in errors)
                + " (device_names 'resourceslice': gpu-<minor> or "
                "gpu-<minor>-mig-<profile>-<profile id>-<start>); nothing was reserved",
                [{"field": e["field"], "reason": e["reason"]} for e in errors])
        _check_channels(requests)
        wanted = digest(requests)
        async with self.locks.hold(uid):
            record = self.checkpoint.data.claims.get(uid)
            if record is not None and record.state == "prepare_completed":
                if record.request_digest != wanted:
                    raise Conflict(f"claim {uid} is already prepared with other devices; "
                                   "unprepare it first", claim=uid)
                if issued_at_ns is not None and (record.issued_at_ns is None
                                                 or issued_at_ns > record.issued_at_ns):
                    # The newest prepare this claim answered: an unprepare stamped before it
                    # is older than the caller's latest wish, and is ignored.
                    record.issued_at_ns = issued_at_ns
                    await self.checkpoint.commit()
                return record
            supersedes = self._tombstones.refuse_late_retry(uid, issued_at_ns)
            if record is not None:  # half-done earlier attempt, or lost in a reboot
                await self._undo(record)
            return await self._prepare(uid, requests, metadata, wanted,
                                       issued_at_ns=issued_at_ns, supersedes=supersedes)

    async def _prepare(self, uid: str, requests: Sequence[DeviceRequest],
                       metadata: Mapping[str, str], wanted: str, *, issued_at_ns: int | None,
                       supersedes: bool) -> ClaimRecord:
        """Existing devices resolve against the last inventory snapshot, confirmed by one
        cheap NVML read per device while the checkpoint is written; when the snapshot is out
        of date (or for slices, which walk the GPUs anyway) against a fresh read (of the GPUs
        a claim of pinned slices names, else of every GPU)."""
        snapshot = self._inventory.gpus
        if snapshot and not any(r.kind == "slice" for r in requests):
            try:
                return await self._prepare_on(uid, requests, metadata, wanted, snapshot,
                                              snapshot_taken=True, issued_at_ns=issued_at_ns,
                                              supersedes=supersedes)
            except existing.Stale:
                pass
        gpus = await self._inventory.refresh(gpus_for(requests, snapshot))
        return await self._prepare_on(uid, requests, metadata, wanted, gpus,
                                      snapshot_taken=False, issued_at_ns=issued_at_ns,
                                      supersedes=supersedes)

    async def _prepare_on(self, uid: str, requests: Sequence[DeviceRequest],
                          metadata: Mapping[str, str], wanted: str, gpus: Sequence[Gpu], *,
                          snapshot_taken: bool, issued_at_ns: int | None,
                          supersedes: bool) -> ClaimRecord:
        targets = existing.targets(requests, gpus, snapshot=snapshot_taken)
        check_slices(requests, gpus)  # every entry is checked before anything is reserved
        shared = self._sharing_plan(requests, targets)
        self.sharing.check(shared)  # 503 before anything changes
        now = time.time()
        record = ClaimRecord(uid=uid, state="prepare_started", devices=[],
                             request_digest=wanted, metadata=dict(metadata),
                             created_at=now, updated_at=now, issued_at_ns=issued_at_ns)
        saved = self._tombstones.save(uid) if supersedes else None
        try:
            positions = [i for i, r in enumerate(requests) if r.kind == "gpu"]
            for position, target in zip(positions, targets, strict=True):
                existing.reserve(self._ledger, self.cdi, record, target,
                                 shared=shared.device(position))
            for request in requests:
                if request.kind == "imex-channel":  # before any slice is made
                    self._reserve_channel(record, request)
            for request in requests:
                if request.kind == "slice":
                    await self._slices.make(record, request.request, profile=request.profile,
                                            gpu_ref=request.gpu, start=request.start,
                                            device_name=request.device, gpus=gpus,
                                            admin_access=request.admin_access)
            await self._await_device_nodes(record, gpus)
            if record.imex is not None:
                assert self._channels is not None, "reserved through it"
                await self._channels.ready(record.imex.domain)
            if has_effects(record) or shared.daemon is not None:
                await self._apply_sharing(record, shared)
            record.cdi_spec = str(self.cdi.claim_path(uid))
            record.state = "prepare_completed"
            record.updated_at = time.time()
            self.checkpoint.data.claims[uid] = record
            if supersedes:  # dropped in the same commit that makes the claim durable
                self._tombstones.drop(uid)
            if not await self._record(record, targets, gpus, snapshot_taken=snapshot_taken):
                raise existing.Stale  # recorded on a stale snapshot: undone just below
        except BaseException as failure:
            if saved is not None:
                self._tombstones.restore(uid, saved)
            await self._undo_failed(record, failure)
            raise
        self._ledger.settle(uid)
        self._events.append("claim.prepared", f"claim {uid} prepared: " + ", ".join(
            d.device_name for d in record.devices), details=claim_details(record))
        return record

    def _reserve_channel(self, record: ClaimRecord, request: DeviceRequest) -> None:
        """Hold the IMEX channel of the request's domain (no await): its device node and
        its major must be on the node, the domain must be this node's."""
        if self._channels is None:
            raise ImexNotConfigured("this agent has no compute domains (set --imex-address)")
        try:
            node = (self.cdi.channel_edits(CHANNEL).device_nodes or ())[0]
        except HostFactsError as err:
            raise ImexChannelMissing(
                f"claim {record.uid}: IMEX channel {CHANNEL} cannot be given: {err} (load "
                "the NVIDIA driver with IMEX channels)", path="/proc/devices") from err
        if self.cdi.missing_nodes([node.path]):
            raise ImexChannelMissing(
                f"claim {record.uid}: the IMEX channel node {node.path} does not exist under "
                f"{self.cdi.dev_root} (create it, e.g. with the driver option "
                "NVreg_CreateImexChannel0=1, or mknod); nothing was prepared", path=node.path)
        assert request.domain is not None, "the API requires it"
        self._channels.reserve(record.uid, request.domain)
        record.imex = ImexChannelRecord(
            request=request.request, domain=request.domain, channel=CHANNEL,
            device_name=CHANNEL_NAME,
            cdi_device=self.cdi.qualified_name(record.uid, CHANNEL_NAME))

    async def _channel_released(self, record: ClaimRecord, *, leave: bool) -> None:
        """Tell the domain its claim let the channel go; a failure there (the daemon's files,
        the domain state) is logged: the claim is gone either way."""
        if record.imex is None or self._channels is None:
            return
        try:
            await self._channels.released(record.imex.domain, leave=leave)
        except (AgentError, OSError) as err:
            log.warning("compute domain not updated after a claim released its channel",
                        extra={"claim": record.uid, "error": str(err)})

    def _sharing_plan(self, requests: Sequence[DeviceRequest],
                      targets: Sequence[existing.Target]) -> SharingPlan:
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
        record.set_daemons(self.sharing.daemon_records(record.uid, shared))
        self.checkpoint.data.claims[record.uid] = record
        await self.checkpoint.commit()
        await self.sharing.apply(record)

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

    async def _record(self, record: ClaimRecord, targets: Sequence[existing.Target],
                      gpus: Sequence[Gpu], *, snapshot_taken: bool) -> bool:
        """Make a completed claim durable and write its spec; on a ``snapshot_taken``,
        whether the snapshot it was resolved on still matches the hardware.

        The checkpoint write starts first; while it is fsync'd the snapshot is confirmed (an
        NVML read can take 0.1-0.5 ms on a real GPU) and the spec written, and this waits for
        all three. A crash between the two writes, in either order, is repaired at start-up:
        specs are rebuilt for completed claims and removed when no claim owns them."""
        committed = self.checkpoint.commit()
        confirming = self._inventory.still_there([(gpu, device) for _, gpu, device in targets]) \
            if snapshot_taken else _true()
        confirmed = asyncio.ensure_future(confirming)
        minors = {g.uuid: g.static.minor for g in gpus}
        # On the loop: a claim spec is a few KiB written without fsync to /var/run/cdi, a
        # tmpfs on hosts (tens of microseconds); handing it to a thread cost more than that.
        try:
            self.cdi.write_claim(record.uid, [(d, minors[d.gpu]) for d in record.devices],
                                 mps_roots=mps_roots(record), channels=channel_specs(record))
        except BaseException:
            await asyncio.gather(committed, confirmed, return_exceptions=True)
            raise
        _, still_there = await asyncio.gather(committed, confirmed)
        return bool(still_there)

    # -- undoing ---------------------------------------------------------------------------

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
                                severity=Severity.ERROR, details=claim_details(record))

    async def unprepare(self, uid: str, *, issued_at_ns: int | None = None) -> None:
        """Unprepare; an unknown claim is a success (unprepare may be repeated). One stamped
        (``issued_at_ns``) before the newest stamped prepare the claim answered is a late
        one and changes nothing."""
        self.recovery.check_usable()
        async with self.locks.hold(uid):
            record = self.checkpoint.data.claims.get(uid)
            if record is None:
                # Never prepared here (or already gone): nothing durable, but a late prepare
                # retry is still refused for the tombstone window.
                self._tombstones.unprepared_unknown(uid, issued_at_ns)
                return
            if issued_at_ns is not None and record.issued_at_ns is not None \
                    and issued_at_ns < record.issued_at_ns:
                log.info("late unprepare ignored", extra={
                    "claim": uid, "issued_at_ns": issued_at_ns,
                    "prepared_at_ns": record.issued_at_ns})
                return
            self._tombstones.unprepared(uid, issued_at_ns)
            if any(device.slice is not None for device in record.devices) or \
                    has_effects(record):
                # Marked durably before a slice is destroyed or a daemon stopped, so that
                # start-up finishes the job after a crash.
                record.state = "unprepare_started"
                await self.checkpoint.commit()
                await self._undo(record)
            else:
                await self._forget(record)
        self._events.append("claim.unprepared", f"claim {uid} unprepared",
                            details=claim_details(record))

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
        await self._channel_released(record, leave=True)

    async def _undo(self, record: ClaimRecord) -> None:
        """Destroy the claim's on-demand slices, remove its spec, release its devices, drop
        it from the checkpoint (durably). Its holds keep others off the devices until then,
        but no longer stand in the way of a transition destroying them."""
        self._ledger.settle(record.uid, "releasing")
        if has_effects(record):
            # Before the holds go: a GPU is handed on only once its daemon is stopped and its
            # compute mode and time slice are back (an error here keeps the holds).
            await self.sharing.undo(record, self._still_needed(record))
        for device in record.devices:
            if device.slice is not None:
                await self._slices.destroy(device, self._inventory.gpus)
        self._ledger.release(record.uid)
        self.cdi.store.remove(self.cdi.claim_path(record.uid))  # on the loop, as it is written
        if self.checkpoint.data.claims.get(record.uid) is record:
            del self.checkpoint.data.claims[record.uid]
        await self.checkpoint.commit()
        await self._channel_released(record, leave=record.state == "unprepare_started")


def _check_channels(requests: Sequence[DeviceRequest]) -> None:
    """A claim holds at most one IMEX channel (pure, before anything is reserved)."""
    positions = [i for i, r in enumerate(requests) if r.kind == "imex-channel"]
    if len(positions) > 1:
        raise InvalidRequest(
            f"devices[{positions[1]}]: a claim holds one IMEX channel (devices[{positions[0]}] "
            "is one already)", [{"field": f"devices[{positions[1]}].kind",
                                  "reason": "a second imex-channel"}])


async def _true() -> bool:
    return True
