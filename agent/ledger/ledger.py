"""The per-GPU ledger: the one authority on each GPU's devices and who holds them.

Everything that may create, destroy or hand out a device asks here first:
- **holds**: a claim holds a whole GPU or a MIG device (by :class:`DeviceKey`, one key however
  the device is named), first *reserved* (before the first NVML mutation or durable write),
  then *prepared*. A hold is exclusive, or a counted share of a capacity (memory, threads)
  that other shares of the same device may add up to;
- **the mutation lock**: one per GPU. A MIG transition holds it from planning to its terminal
  state; an on-demand slice holds it while NVML makes or destroys the instance. So a slice is
  never made on a GPU whose geometry is changing, and a plan always sees every slice;
- **marks**: the instances a transition drains or has just created (not claimable),
  quarantine (durable, ``<state>/mig/quarantine.json``; unreadable quarantine state
  quarantines every MIG-capable GPU, since which ones were meant can no longer be known) and
  an operator's drain (durable, ``<state>/health/drain.json``; it keeps new claims off and
  leaves held ones alone);
- **availability**: one read model. A GPU's faults (its health's: XIDs, lost, unmonitored;
  its NVLink fabric's as the inventory last read it; the ledger's own: quarantine, drain)
  become device taints (``agent/health/taints.py``), and only the *blocking* taints make a
  device unavailable (an informational one never does); then a transition's marks, then
  holders. Claims, topology selection, ResourceSlices, metrics and the API all consult it.

It holds no NVML handle and does no I/O but the quarantine and drain files; it lives on the
event loop (its checks and takes never await, so check-then-take is atomic).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from agent.durable import DurableMap
from agent.errors import Conflict, DeviceBusy, DeviceUnavailable
from agent.events import EventLog, Severity
from agent.gpu.types import Gpu, MigDevice, Placement
from agent.health.fabric import fabric_faults
from agent.health.taints import Fault, Taint, blocking_reasons, device_taints, label_value
from agent.ledger.keys import DeviceKey, key_of

#: ``releasing``: its claim is being unprepared; it still keeps others off the device, but no
#: longer blocks a transition that destroys it, nor does a rollback keep it.
HoldState = Literal["reserved", "prepared", "releasing"]
PLANNING = "(being planned)"


@dataclass(frozen=True)
class Share:
    """A counted part of a device's capacity, e.g. ``Share("memory_mib", 10240)``."""

    capacity: str
    amount: int


@dataclass(frozen=True)
class Hold:
    """A claim's hold on one device. ``profile`` is a MIG device's profile (what a rollback
    re-creates); ``on_demand`` marks a slice made for the claim, which is not part of the
    node's desired geometry; no ``shares`` means exclusive.

    ``admin`` is a third kind: a monitoring tool's hold (DRA ``adminAccess``). It never
    blocks another hold and is never blocked by one, does not count as a holder in the
    device's availability, and does not stand in the way of a geometry change: a transition
    that destroys its device makes its claim lost instead (the claims service says so)."""

    holder: str
    key: DeviceKey
    state: HoldState = "reserved"
    profile: str | None = None
    on_demand: bool = False
    shares: tuple[Share, ...] = ()
    admin: bool = False

    @property
    def kind(self) -> Literal["exclusive", "share", "admin"]:
        return "admin" if self.admin else "share" if self.shares else "exclusive"

    @property
    def exclusive(self) -> bool:
        return self.kind == "exclusive"

    def compatible(self, other: Hold) -> bool:
        """Whether both may be held at once (capacity aside): one holder's own holds, devices
        that do not overlap, two shares of the same device, or an admin hold with anything."""
        return (self.holder == other.holder or self.admin or other.admin
                or not self.key.conflicts(other.key)
                or (self.kind == other.kind == "share" and self.key == other.key))


@dataclass(frozen=True)
class Availability:
    """Whether a GPU or MIG device can be handed out, and why not."""

    reasons: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return not self.reasons and not self.holders


@dataclass
class GpuLedger:
    """One GPU's entry. Mutated only through :class:`NodeLedger`."""

    uuid: str
    index: int = -1
    mig_capable: bool = True
    holds: list[Hold] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The transition owning the mutation lock (``PLANNING`` until it has an id).
    transition: str | None = None
    #: Placements a transition drains (destroys) or has created and not yet verified.
    draining: dict[Placement, str] = field(default_factory=dict)
    creating: dict[Placement, str] = field(default_factory=dict)
    quarantine: str | None = None
    quarantined_since: float = 0.0
    #: An operator's drain: (reason, since).
    drain: tuple[str, float] | None = None


#: The driver name of the taint keys when none is given (the agent's default).
DEFAULT_TAINT_DRIVER = "gpu.nodeagent.dev"


class NodeLedger:
    """The ledgers of every GPU on the node. ``faults`` gives a GPU's health faults (XIDs,
    lost, unmonitored); ``driver`` and ``no_execute`` shape the taints they become."""

    def __init__(self, *, quarantine_path: Path, events: EventLog,
                 faults: Callable[[str], tuple[Fault, ...]] = lambda _: (),
                 lost_reason: Callable[[str], str | None] = lambda _: None,
                 drain_path: Path | None = None, driver: str = DEFAULT_TAINT_DRIVER,
                 no_execute: bool = False) -> None:
        self._events = events
        self._faults = faults
        self._lost_reason = lost_reason
        self.driver = driver
        self.no_execute = no_execute
        self._quarantine = DurableMap(quarantine_path, format="gpu-agent-mig-quarantine")
        self._drain = DurableMap(drain_path or quarantine_path.with_name("drain.json"),
                                 format="gpu-agent-drain")
        #: When an inventory read error was first seen on a GPU NVML does not call lost.
        self._unreadable_since: dict[str, float] = {}
        #: When each fabric fault of a GPU was first seen, by (kind, value).
        self._fabric_since: dict[str, dict[tuple[str, str | None], float]] = {}
        self._gpus: dict[str, GpuLedger] = {}
        self._frozen: str | None = None
        #: Called with a GPU's UUID after its instances changed (derived state is stale).
        self.watchers: list[Callable[[str], None]] = []

    # -- the GPUs ----------------------------------------------------------------------------

    @property
    def frozen(self) -> str | None:
        """Why nobody can know who holds what (the claims checkpoint is unusable): every
        change that could destroy a held device is refused meanwhile."""
        return self._frozen

    def freeze(self, reason: str) -> None:
        """Nobody can know who holds what until :meth:`thaw`."""
        self._frozen = reason

    def thaw(self) -> None:
        self._frozen = None

    def lost_reason(self, gpu: str) -> str | None:
        """Why the GPU is lost (it answered GPU_IS_LOST), or None."""
        return self._lost_reason(gpu)

    async def register(self, gpus: Iterable[Gpu]) -> None:
        """Know the node's GPUs (after the inventory is loaded) and their quarantine marks.
        Unreadable quarantine state quarantines every MIG-capable GPU, durably where the
        disk allows, until an operator clears each one."""
        unreadable = self._quarantine.problem
        for gpu in gpus:
            entry = self.gpu(gpu.uuid)
            entry.index, entry.mig_capable = gpu.index, gpu.static.mig_capable
            drained = self._drain.get(gpu.uuid)
            if isinstance(drained, dict):
                entry.drain = (str(drained.get("reason", "drained")),
                               _since(drained.get("since")))
            record = self._quarantine.get(gpu.uuid)
            if record is not None:
                entry.quarantine = str(record.get("reason", "quarantined"))
                entry.quarantined_since = _since(record.get("since"))
            elif unreadable and gpu.static.mig_capable:
                await self.quarantine(gpu.uuid, f"the quarantine state was unreadable "
                                      f"({unreadable}); which GPUs were quarantined can no "
                                      "longer be known")
        if unreadable:
            self._events.append("mig.state_unreadable", unreadable, severity=Severity.ERROR)
        drain_problem = self._drain.problem
        if drain_problem:
            # Which GPUs an operator drained can no longer be known: all of them stay drained
            # (new claims off, held ones untouched) until an operator undrains each.
            reason = f"the drain state was unreadable ({drain_problem})"
            for gpu in gpus:
                entry = self.gpu(gpu.uuid)
                if entry.drain is None:
                    # In memory even where the disk refuses it (then until the next start).
                    entry.drain = (reason, time.time())
                    with contextlib.suppress(OSError):
                        await self._drain.set(gpu.uuid, {"reason": reason,
                                                         "since": entry.drain[1]})
            self._events.append("gpu.drain_state_unreadable", drain_problem,
                                severity=Severity.ERROR)

    def gpu(self, uuid: str) -> GpuLedger:
        entry = self._gpus.get(uuid)
        if entry is None:
            entry = self._gpus[uuid] = GpuLedger(uuid)
        return entry

    # -- holds -------------------------------------------------------------------------------

    def holds(self, gpu: str | None = None) -> list[Hold]:
        """Every hold, or those on one GPU."""
        if gpu is not None:
            return list(self.gpu(gpu).holds)
        return [h for entry in self._gpus.values() for h in entry.holds]

    def holders(self, key: DeviceKey) -> tuple[str, ...]:
        """The claims whose holds overlap ``key`` (the whole GPU overlaps all on it); admin
        holds take nothing from anyone and are not counted."""
        return tuple(dict.fromkeys(h.holder for h in self.gpu(key.gpu).holds
                                   if not h.admin and h.key.conflicts(key)))

    def take(self, hold: Hold, *, name: str, capacity: Mapping[str, int] | None = None) -> None:
        """Register ``hold`` (``name`` is how the caller named the device, for the message),
        or raise :class:`DeviceBusy` naming the holders in the way."""
        entry = self.gpu(hold.key.gpu)
        if hold in entry.holds:
            return  # taken already (a start-up retried from the beginning)
        blocking = [h for h in entry.holds if not hold.compatible(h)]
        if blocking:
            holders = list(dict.fromkeys(h.holder for h in blocking))
            raise DeviceBusy(f"{name} is held by claim {', '.join(holders)}", device=name,
                             holders=holders)
        if hold.shares:
            over = self._over_capacity(entry, hold, capacity or {}, name)
            if over is not None:
                raise over
        entry.holds.append(hold)

    @staticmethod
    def _over_capacity(entry: GpuLedger, hold: Hold,
                       capacity: Mapping[str, int], name: str) -> DeviceBusy | None:
        """The refusal of a share that would take more than the capacity left, saying what is
        taken, by whom, and what is left; None when it fits."""
        sharing = [h for h in entry.holds if h.key == hold.key and h.holder != hold.holder
                   and h.kind == "share"]
        for share in hold.shares:
            used = sum(s.amount for h in sharing for s in h.shares if s.capacity == share.capacity)
            total = capacity.get(share.capacity, 0)
            if used + share.amount <= total:
                continue
            holders = list(dict.fromkeys(h.holder for h in sharing))
            unit = " MiB" if share.capacity.endswith("_mib") else ""
            what = share.capacity.removesuffix("_mib")
            by = f" by claim {', '.join(holders)}" if holders else ""
            return DeviceBusy(
                f"{name}: a share of {share.amount}{unit} of {what} would overcommit "
                f"it: {used}{unit} of {total}{unit} are taken{by}, {max(0, total - used)}{unit} "
                "left", device=name, holders=holders)
        return None

    def settle(self, holder: str, state: HoldState = "prepared") -> None:
        """The holder's holds are now ``prepared`` (its claim is durable) or ``releasing``."""
        for entry in self._gpus.values():
            entry.holds[:] = [replace(h, state=state) if h.holder == holder else h
                              for h in entry.holds]

    def keeping(self, gpu: str) -> list[Hold]:
        """The holds that block a change of ``gpu``'s geometry and that a rollback keeps (not
        those being released, nor admin holds: monitoring never blocks a geometry change)."""
        return [h for h in self.gpu(gpu).holds if h.state != "releasing" and not h.admin]

    def release(self, holder: str, key: DeviceKey | None = None) -> None:
        """Drop the holder's holds (only the one on ``key`` when given)."""
        for entry in self._gpus.values():
            entry.holds[:] = [h for h in entry.holds
                              if h.holder != holder or (key is not None and h.key != key)]

    def on_demand(self, gpu: str) -> frozenset[tuple[str, Placement]]:
        """(profile, placement) of the slices made for claims on ``gpu``: not part of the
        node's geometry, so neither remembered as desired nor reported as drift."""
        return frozenset((h.profile, h.key.placement) for h in self.gpu(gpu).holds
                         if h.on_demand and h.profile is not None and h.key.placement is not None)

    # -- availability ------------------------------------------------------------------------

    def health_marks(self, gpu_uuid: str) -> tuple[str | None, tuple[Fault, ...]]:
        """The GPU's live health, besides what the inventory last read: why it is lost, if
        it is, and its health faults. They change the moment a GPU is lost, reset or
        cleared, before any inventory read shows it."""
        return self._lost_reason(gpu_uuid), self._faults(gpu_uuid)

    def faults(self, gpu: Gpu) -> tuple[Fault, ...]:
        """Everything wrong with the GPU: its health faults, an inventory read error on a
        GPU NVML does not call lost (as lost: it does not answer), its fabric's (registration
        not done or failed, a flagged health mask), quarantine, drain."""
        found = list(self._faults(gpu.uuid))
        if gpu.health.reasons and not any(f.kind == "gpu-lost" for f in found):
            since = self._unreadable_since.setdefault(gpu.uuid, time.time())
            found.append(Fault(kind="gpu-lost", reason=gpu.health.reasons[0], since=since))
        else:
            self._unreadable_since.pop(gpu.uuid, None)
        fabric = fabric_faults(gpu.fabric, seen=self._fabric_since.get(gpu.uuid, {}),
                               now=time.time())
        # Only what is there now is remembered: a fault that went and comes back is new.
        self._fabric_since[gpu.uuid] = {(f.kind, f.value): f.since for f in fabric}
        found.extend(fabric)
        entry = self.gpu(gpu.uuid)
        if entry.quarantine is not None:
            found.append(Fault(kind="quarantined", reason=f"quarantined: {entry.quarantine}",
                               since=entry.quarantined_since))
        if entry.drain is not None:
            reason, since = entry.drain
            found.append(Fault(kind="drain", reason=f"drained: {reason}", since=since,
                               value=label_value(reason) or None))
        return tuple(found)

    def taints(self, gpu: Gpu, device: MigDevice | None = None) -> tuple[Taint, ...]:
        """The taints of the GPU (or of one MIG device on it: the GPU's, and its own
        instance's)."""
        instance = None if device is None else (device.gi_id, device.ci_id)
        return device_taints(self.faults(gpu), driver=self.driver, no_execute=self.no_execute,
                             instance=instance)

    def condition(self, gpu: Gpu, device: MigDevice | None = None) -> tuple[str, ...]:
        """Why nothing on this GPU (or this MIG device) may be handed out: the reasons of
        its blocking taints (lost, an XID, quarantined, drained; never an informational
        one)."""
        return tuple(dict.fromkeys(blocking_reasons(self.taints(gpu, device))))

    def availability(self, gpu: Gpu, device: MigDevice | None = None) -> Availability:
        """The one answer to "can this GPU (or MIG device) be handed out now, and if not,
        why": its blocking taints, a transition's marks on the device, and its holders."""
        reasons = list(self.condition(gpu, device))
        entry = self.gpu(gpu.uuid)
        if device is not None:
            tid = entry.draining.get(device.placement)
            if tid is not None:
                reasons.append(f"{device.uuid} is being drained by MIG transition {tid}")
            tid = entry.creating.get(device.placement)
            if tid is not None:
                reasons.append(f"{device.uuid} is being created by MIG transition {tid}")
        return Availability(tuple(reasons), self.holders(key_of(gpu, device)))

    def check_usable(self, gpu: Gpu, device: MigDevice | None = None) -> None:
        """Raise when the device (or, without one, the GPU) cannot be handed out for a reason
        other than its holders: :class:`DeviceUnavailable` naming its blocking taints, or
        :class:`DeviceBusy` for a transition's drain or creation mark."""
        condition = self.condition(gpu, device)
        if condition:
            raise DeviceUnavailable(f"GPU {gpu.index} is unavailable: {'; '.join(condition)}",
                                    gpu=gpu.uuid,
                                    device=device.uuid if device else None,
                                    reason=condition[0])
        marks = self.availability(gpu, device).reasons
        if marks:
            raise DeviceBusy("; ".join(marks), gpu=gpu.uuid,
                             device=device.uuid if device else None,
                             transition=self.gpu(gpu.uuid).transition)

    def quarantined(self, gpu: str) -> str | None:
        return self.gpu(gpu).quarantine

    def draining(self, gpu: str) -> frozenset[Placement]:
        entry = self.gpu(gpu)
        return frozenset((*entry.draining, *entry.creating))

    # -- the mutation lock -------------------------------------------------------------------

    def busy(self, gpu: str) -> str | None:
        """The transition in flight on ``gpu`` (or being planned), if any."""
        return self.gpu(gpu).transition

    @asynccontextmanager
    async def slice_change(self, gpu: str, *, wait: bool = False) -> AsyncIterator[None]:
        """Hold ``gpu``'s mutation lock to make or destroy one on-demand slice. Making one is
        refused with :class:`DeviceBusy` while a MIG transition owns the GPU; destroying one
        (``wait``) waits for the transition to end instead."""
        entry = self.gpu(gpu)
        if entry.transition is not None and not wait:
            raise DeviceBusy(f"GPU {entry.index} is busy with MIG transition {entry.transition}",
                             gpu=gpu, transition=entry.transition)
        async with entry.lock:
            yield
        self.geometry_changed(gpu)

    async def begin_transition(self, gpu: str) -> None:
        """Own ``gpu`` for a transition being planned (waits only for a slice being made);
        :class:`Conflict` when another transition owns it."""
        entry = self.gpu(gpu)
        if entry.transition is not None:
            raise Conflict(f"GPU {entry.index} is busy with transition {entry.transition}",
                           gpu=gpu, transition=None if entry.transition == PLANNING
                           else entry.transition)
        entry.transition = PLANNING
        try:
            await entry.lock.acquire()
        except BaseException:
            entry.transition = None
            raise

    def name_transition(self, gpu: str, transition: str, *, drain: Iterable[Placement] = (),
                        create: Iterable[Placement] = ()) -> None:
        """The planned transition's id and the instances it destroys and creates."""
        entry = self.gpu(gpu)
        entry.transition = transition
        entry.draining = dict.fromkeys(drain, transition)
        entry.creating = dict.fromkeys(create, transition)

    def end_transition(self, gpu: str, *, changed: bool) -> None:
        """Release ``gpu``: marks cleared, lock released, watchers told if it changed."""
        entry = self.gpu(gpu)
        entry.transition = None
        entry.draining, entry.creating = {}, {}
        if entry.lock.locked():
            entry.lock.release()
        if changed:
            self.geometry_changed(gpu)

    def geometry_changed(self, gpu: str) -> None:
        for watcher in self.watchers:
            watcher(gpu)

    # -- quarantine --------------------------------------------------------------------------

    async def quarantine(self, gpu: str, reason: str) -> None:
        """Quarantine ``gpu``, durably, and say so (an error event with what an operator does
        next). The mark holds in memory even where the disk refuses it; the event then says
        it will not survive a restart."""
        entry = self.gpu(gpu)
        entry.quarantine = reason
        entry.quarantined_since = time.time()
        durable = ""
        try:
            await self._quarantine.set(gpu, {"reason": reason, "since": time.time()})
        except OSError as err:
            durable = f" (not written to disk: {err}; it does not survive a restart)"
        self._events.append(
            "mig.quarantined",
            f"GPU {entry.index} quarantined: {reason}{durable}. Operator: compare 'nvidia-smi "
            "mig -lgi' with GET /v1/gpus/{gpu}/mig, restore or clear the layout by hand, then "
            "clear the quarantine", severity=Severity.ERROR, gpu=gpu)

    async def clear_quarantine(self, gpu: str) -> str:
        """Lift the quarantine; returns its reason. :class:`Conflict` if there is none."""
        entry = self.gpu(gpu)
        if entry.quarantine is None:
            raise Conflict(f"GPU {entry.index} is not quarantined", gpu=gpu)
        await self._quarantine.delete(gpu)
        reason, entry.quarantine = entry.quarantine, None
        return reason


    # -- an operator's drain -----------------------------------------------------------------

    def drained(self, gpu: str) -> str | None:
        """Why an operator drained ``gpu``, or None."""
        drain = self.gpu(gpu).drain
        return None if drain is None else drain[0]

    async def drain(self, gpu: str, reason: str) -> bool:
        """Keep new claims off ``gpu`` (a ``NoSchedule`` drain taint), durably; held claims
        stay. False when it was drained already (its reason and time are kept). Raises
        :class:`StorageUnavailable` with nothing changed when the disk refuses it."""
        entry = self.gpu(gpu)
        if entry.drain is not None:
            return False
        since = time.time()
        await self._drain.set(gpu, {"reason": reason, "since": since})
        entry.drain = (reason, since)
        return True

    async def undrain(self, gpu: str) -> str:
        """Lift the drain; returns its reason. :class:`Conflict` if there is none."""
        entry = self.gpu(gpu)
        if entry.drain is None:
            raise Conflict(f"GPU {entry.index} is not drained", gpu=gpu)
        await self._drain.delete(gpu)
        reason, entry.drain = entry.drain[0], None
        return reason


def _since(value: object) -> float:
    """A stored time (seconds since the epoch); 0 where an older file has none."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else 0.0
