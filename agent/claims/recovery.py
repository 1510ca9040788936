"""Claims the node no longer backs, and the checkpoint they are read from: start-up (holds
loaded before journal recovery, then claims of a previous boot marked lost, half-done
prepares and unprepares rolled back, every spec rebuilt, orphans removed), an operator's
answer to a corrupt checkpoint, and admin-access claims whose device a geometry change
destroyed. A corrupt checkpoint, or a missing one where the node shows evidence of claims,
freezes claims (and every geometry change that could destroy what they hold) until an
operator acts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from agent.claims.cdi_writer import CdiWriter
from agent.claims.channels import Channels, channel_specs
from agent.claims.checkpoint import (
    CheckpointCorrupt,
    CheckpointData,
    ClaimCheckpoint,
    ClaimRecord,
    decode,
    encode,
)
from agent.claims.daemons import DaemonSupervisor
from agent.claims.locks import ClaimLocks
from agent.claims.records import UNBOUNDED, claim_details, hold_of, mps_roots, present
from agent.claims.sharing_runtime import SharingRuntime
from agent.durable import write_atomic
from agent.errors import AgentError, CheckpointUnusable, Conflict, NotFound
from agent.events import EventLog, Severity
from agent.gpu.inventory import GpuInventory
from agent.ledger.ledger import NodeLedger

log = logging.getLogger("agent.claims")
MARKER = "claims-checkpoint.marker"


class ClaimRecovery:
    def __init__(self, *, checkpoint: ClaimCheckpoint, ledger: NodeLedger,
                 inventory: GpuInventory, cdi: CdiWriter, events: EventLog,
                 sharing: SharingRuntime, daemons: DaemonSupervisor, locks: ClaimLocks,
                 undo: Callable[[ClaimRecord], Awaitable[None]],
                 refresh_node_spec: Callable[[], Awaitable[None]],
                 run_dir: Path | None, channels: Channels | None = None) -> None:
        self._checkpoint = checkpoint
        self._channels = channels
        self._ledger = ledger
        self._inventory = inventory
        self._cdi = cdi
        self._events = events
        self._sharing = sharing
        self._daemons = daemons
        self._locks = locks
        #: The claims service's undo (slices destroyed, sharing reset, holds released).
        self._undo = undo
        self._refresh_node_spec = refresh_node_spec
        self._marker = run_dir / MARKER if run_dir is not None else None
        self._marked = False
        self._previous_boot: str | None = None
        #: Why claims are frozen (corrupt or missing checkpoint), or None.
        self.corrupt: str | None = None

    def check_usable(self) -> None:
        """:class:`CheckpointUnusable` while claims are frozen, saying what an operator does."""
        if self.corrupt is not None:
            raise CheckpointUnusable(
                f"{self.corrupt}; claims are frozen until an operator inspects it and either "
                "restores it or accepts an empty checkpoint: 'gpu-agent admin checkpoint' or "
                "POST /v1/admin/claims-checkpoint (see docs/operations.md)")

    # -- start-up --------------------------------------------------------------------------

    async def load(self) -> None:
        """Before journal recovery: read the checkpoint and put the holds of prepared claims
        in the ledger, so a rollback at start-up keeps their instances."""
        existed = await asyncio.to_thread(self._checkpoint.path.exists)
        try:
            previous_boot = await asyncio.to_thread(self._checkpoint.load)
        except CheckpointCorrupt as err:
            self._freeze(str(err))
            return
        if not existed:
            evidence = await asyncio.to_thread(self._evidence)
            if evidence:
                self._freeze(f"claims checkpoint {self._checkpoint.path} is missing, but "
                             f"{evidence}: prepared claims may hold devices nobody can name")
                return
        self._previous_boot = previous_boot
        if previous_boot is not None:
            return  # every claim of the previous boot is lost (reconcile marks them)
        gpus = {g.uuid: g for g in self._inventory.gpus}
        for record in self._checkpoint.data.claims.values():
            # A half-done claim's shared GPUs stay held until reconcile has reset them.
            half_done = record.state in ("prepare_started", "unprepare_started")
            if record.state != "prepare_completed" and not half_done:
                continue
            if record.imex is not None and self._channels is not None \
                    and record.state == "prepare_completed":
                self._channels.hold(record.uid)
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
                self._ledger.take(hold_of(record.uid, device, profile, state="prepared"),
                                  name=device.device_name, capacity=UNBOUNDED)

    def _evidence(self) -> str | None:
        """What shows claims were prepared on this boot though the checkpoint is gone: claim
        CDI specs, or the run directory's marker of a checkpoint written on this boot."""
        specs = self._cdi.claim_specs()
        if specs:
            return f"{len(specs)} claim CDI spec(s) are in {self._cdi.store.directory}"
        if self._marker is not None:
            try:
                marker = json.loads(self._marker.read_bytes())
            except (OSError, ValueError):
                return None
            if isinstance(marker, dict) and marker.get("boot_id") == \
                    self._checkpoint.data.boot_id and \
                    marker.get("checkpoint") == str(self._checkpoint.path):
                return f"{self._marker} says a checkpoint was written on this boot"
        return None

    def _freeze(self, reason: str) -> None:
        self.corrupt = reason
        self._ledger.freeze(f"claims are frozen ({reason})")
        self._events.append("claims.checkpoint_corrupt", reason, severity=Severity.ERROR)

    async def reconcile(self) -> None:
        """Before ready: mark claims of a previous boot lost, roll back half-done prepares
        and unprepares, rebuild every spec, remove specs nobody owns. A claim that cannot be
        cleaned up (its GPU is lost) keeps its record and state, and the node still becomes
        ready."""
        if self.corrupt is not None:
            return
        gpus = {g.uuid: g for g in await self._inventory.refresh()}
        for record in list(self._checkpoint.data.claims.values()):
            if self._previous_boot is not None and record.state != "lost":
                record.state = "lost"
                record.lost_reason = f"the node rebooted (boot id {self._previous_boot} " \
                                     "gone): its devices were released"
                self._lost(record)
            elif record.state in ("prepare_started", "unprepare_started"):
                self._events.append("claim.recovered", f"claim {record.uid} was "
                                    f"{record.state.replace('_', ' ')} when the agent stopped; "
                                    "rolled back", details=claim_details(record))
                try:
                    await self._undo(record)
                except AgentError as err:
                    record.lost_reason = f"could not be cleaned up: {err.detail}"
                    self._events.append("claim.cleanup_failed", f"claim {record.uid}: "
                                        f"{record.lost_reason}", severity=Severity.ERROR,
                                        details=claim_details(record))
        owned: set[str] = set()
        for record in self._checkpoint.data.claims.values():
            if record.state != "prepare_completed":
                if record.state == "lost" or record.lost_reason:
                    owned.add(str(self._cdi.claim_path(record.uid)))
                continue
            missing = [d.device_name for d in record.devices if not present(d, gpus)]
            lost = [d.device_name for d in record.devices
                    if self._ledger.lost_reason(d.gpu) is not None]
            if missing or lost:
                record.state = "lost"
                record.lost_reason = (f"its GPU is lost: {', '.join(lost)}" if lost
                                      else f"devices vanished: {', '.join(missing)}")
                self._lost(record)
                if not lost:  # a lost GPU's devices stay held: nobody else may get them
                    self._ledger.release(record.uid)
                continue
            path = await asyncio.to_thread(partial(
                self._cdi.write_claim, record.uid,
                [(d, gpus[d.gpu].static.minor) for d in record.devices],
                mps_roots=mps_roots(record), channels=channel_specs(record)))
            owned.add(str(path))
            await self._reapply_sharing(record)
            if record.daemons():
                await self._daemons.adopt(record)
        for path in await asyncio.to_thread(self._cdi.claim_specs):
            if str(path) not in owned:
                await asyncio.to_thread(self._cdi.store.remove, path)
                log.info("removed a claim spec no claim owns", extra={"path": str(path)})
        self._previous_boot = None
        await self._checkpoint.commit()
        await self._mark_boot()
        await self._refresh_node_spec()

    def _lost(self, record: ClaimRecord) -> None:
        self._events.append("claim.lost", f"claim {record.uid}: {record.lost_reason}",
                            severity=Severity.WARNING, details=claim_details(record))

    async def _reapply_sharing(self, record: ClaimRecord) -> None:
        """A prepared claim's compute mode and time slice are set again (a GPU reset while the
        agent was down would have put back the defaults); a failure is reported and the
        claim kept (its holds keep the GPU from anyone else)."""
        try:
            await self._sharing.reapply(record)
        except AgentError as err:
            self._events.append("claim.sharing_not_reapplied", f"claim {record.uid}: its "
                                f"sharing settings could not be set again: {err.detail}",
                                severity=Severity.ERROR, details=claim_details(record))

    async def _mark_boot(self) -> None:
        """Note, outside the state directory, that this boot has a checkpoint: if the state
        directory is deleted, the next start on this boot knows claims may exist."""
        if self._marker is None or self._marked:
            return
        body = json.dumps({"boot_id": self._checkpoint.data.boot_id,
                           "checkpoint": str(self._checkpoint.path)}).encode()
        try:
            await asyncio.to_thread(write_atomic, self._marker, body, mode=0o600)
            self._marked = True
        except OSError as err:
            log.warning("run-directory marker not written", extra={"error": str(err)})

    # -- an operator's answer --------------------------------------------------------------

    async def remediate(self, restore: str | None) -> None:
        """Put back a kept-aside file (``restore``, its name next to the checkpoint, which
        must now pass its check) or start from an empty one (``None``); then load and
        reconcile as at start-up. The kept-aside files stay."""
        if self.corrupt is None:
            raise Conflict("the claims checkpoint is not corrupt: nothing to restore or accept")
        path = self._checkpoint.path
        if restore is None:
            raw = encode(CheckpointData(boot_id=self._checkpoint.data.boot_id))
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
        self._ledger.thaw()
        how = f"restored from {restore}" if restore else "replaced by an empty one"
        self._events.append("claims.checkpoint_remediated", f"claims checkpoint {how}",
                            severity=Severity.WARNING)
        await self.load()
        await self.reconcile()

    # -- after a geometry change -----------------------------------------------------------

    async def lose_destroyed_admin_claims(self) -> None:
        """On the inventory just refreshed: a claim whose admin-held MIG device a transition
        destroyed (admin holds do not block one) is lost, its holds released and its spec
        removed, so no container is started on a device that is gone."""
        if self.corrupt is not None:
            return
        gpus = {g.uuid: g for g in self._inventory.gpus}
        for record in list(self._checkpoint.data.claims.values()):
            if record.state != "prepare_completed" or \
                    not any(d.admin_access and not present(d, gpus) for d in record.devices):
                continue
            async with self._locks.hold(record.uid):
                if self._checkpoint.data.claims.get(record.uid) is not record or \
                        record.state != "prepare_completed":
                    continue  # unprepared meanwhile
                # Confirmed on a fresh read: the claim may have been prepared on a device
                # made after the snapshot this started from.
                gpus = {g.uuid: g for g in await self._inventory.refresh()}
                gone = [d.device_name for d in record.devices if not present(d, gpus)]
                if not any(d.admin_access and not present(d, gpus) for d in record.devices):
                    continue
                record.state = "lost"
                record.lost_reason = ("a MIG geometry change destroyed its admin-access "
                                      f"device(s): {', '.join(gone)}")
                record.updated_at = time.time()
                self._ledger.release(record.uid)
                self._cdi.store.remove(self._cdi.claim_path(record.uid))
                await self._checkpoint.commit()
            self._lost(record)
