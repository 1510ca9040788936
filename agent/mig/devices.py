"""The one path into a GPU's MIG instances: every change of them, a node's geometry change or a
slice made on demand for a claim, goes through :class:`MigDevices`, under the ledger's
mutation lock of its GPU, journaled before its first NVML mutation, run step by step, verified
against a fresh walk, and rolled back on any failure by the same code. A slice is a
one-instance transition: its plan keeps every other instance and creates (or destroys) one.

MIG mode for slices (``--dynamic-mig``, reference ``dra-driver.md`` 3): on Hopper and newer a
mode change takes effect without a GPU reset, so the first slice made for a scheduler's
allocation on a GPU with MIG off switches MIG on in the same transition. The agent remembers,
durably, that a slice switched it on (``<state>/mig/mig-on-for-slices/<uuid>``), and the
unprepare that destroys the GPU's last instance switches it off again: with MIG on the GPU
cannot be handed out whole, so leaving it on would take the full GPU out of the pool for good
(NVIDIA's driver does the same). A GPU whose MIG an operator switched on stays on. Ampere is
never toggled (its mode change needs a reset, which could wedge a VM's GPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from agent.durable import FileKind, fsync_dir, write_durable
from agent.errors import DeviceBusy, DeviceUnavailable, NotFound, NvmlError
from agent.events import EventLog
from agent.gpu import mig
from agent.gpu.session import NvmlSession
from agent.gpu.types import Gpu, GpuProcess, Placement
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics
from agent.mig.executor import GpuMutator, steps_of
from agent.mig.geometry import Geometry, Instance, Plan
from agent.mig.journal import JournalEntry, TransitionJournal, new_entry
from agent.mig.transition import DrainPolicy, StepRecord, Transition, TransitionState

log = logging.getLogger("agent.mig")
_MARK = FileKind("gpu-agent-mig-on-for-slices", 1)
RESET_TIMEOUT_S = 120


@dataclass(frozen=True)
class MadeSlice:
    """The instance a slice got: its GI and CI ids and its MIG device UUID."""

    gi_id: int
    ci_id: int
    uuid: str


class PlacementTaken(Exception):
    """The fresh walk under the GPU's lock shows an instance where the slice was to go (made
    behind the agent's back since the choice): choose again (never reaches a caller of the
    agent)."""


class VerifyFailed(Exception):
    """After applying, the hardware does not show the planned geometry."""


class ModeStayedPending(Exception):
    """A MIG mode change a slice needed did not take effect (processes run on the GPU)."""


class MigDevices:
    """The journal, the mutator and the ledger's per-GPU lock, behind one door."""

    def __init__(self, *, session: NvmlSession, ledger: NodeLedger, journal: TransitionJournal,
                 events: EventLog, metrics: AgentMetrics, reset_command: str | None = None,
                 on_reset: Callable[[str], None] = lambda _gpu: None) -> None:
        self._session = session
        self._ledger = ledger
        self.journal = journal
        self._events = events
        self._metrics = metrics
        self._reset_command = reset_command
        #: Told a GPU's UUID after --gpu-reset-command reset it (its XID marks are stale).
        self._on_reset = on_reset

    @property
    def can_reset(self) -> bool:
        """Whether --gpu-reset-command is configured."""
        return self._reset_command is not None

    # -- reading --------------------------------------------------------------------------

    def _mutator(self, gpu: Gpu) -> GpuMutator:
        return GpuMutator(self._session, gpu.uuid, gpu.profiles)

    async def geometry(self, gpu: Gpu) -> Geometry:
        """The GPU's geometry from a fresh NVML walk (read pool)."""
        return await self._session.read(self._mutator(gpu).geometry)

    async def energy_mj(self, gpu: Gpu) -> int | None:
        """The GPU's total energy counter, which counts from zero again whenever the driver
        loads (the one reading that tells a driver reload from the same driver); None where
        the GPU has none (before Volta) or the read fails."""
        try:
            return await self._session.read(lambda: self._session.total_energy_mj(gpu.uuid))
        except NvmlError:
            return None

    async def processes(self, gpu: Gpu) -> tuple[GpuProcess, ...]:
        def read() -> tuple[GpuProcess, ...]:
            handle = self._session.gpu_handle(gpu.uuid)
            return mig.running_processes(self._session, handle, gpu.uuid)
        return await self._session.read(read)

    async def current(self, gpu: Gpu) -> tuple[Geometry, tuple[GpuProcess, ...]]:
        """The GPU's geometry from a fresh walk, instances in use (by a process or a claim
        in the ledger) marked held, and its processes."""
        processes = await self.processes(gpu)
        busy = sorted({p.gi_id for p in processes if p.gi_id is not None})
        geometry = await self._session.read(partial(self._mutator(gpu).geometry, busy))
        held = [h.key.placement for h in self._ledger.keeping(gpu.uuid)]
        if any(held):
            geometry = Geometry(mig_enabled=geometry.mig_enabled, instances=tuple(
                replace(i, held=True) if any(p is not None and p.overlaps(i.placement)
                                             for p in held) else i
                for i in geometry.instances))
        return geometry, processes

    async def verify(self, gpu: Gpu, target: Geometry) -> str | None:
        """Why the hardware differs from ``target`` (None when it matches)."""
        return await self._session.mutate(gpu.uuid, partial(self._mutator(gpu).verify, target))

    # -- the GPU's mutation lock, for a node's geometry change ----------------------------

    async def own(self, gpu: str) -> None:
        """Own the GPU for a transition being planned or resolved (:class:`Conflict` when
        another owns it; waits only for a slice being made)."""
        await self._ledger.begin_transition(gpu)

    def name(self, gpu: Gpu, t: Transition) -> None:
        """The planned transition's id, and the instances it drains and creates."""
        self._ledger.name_transition(gpu.uuid, t.id,
                                     drain=(i.placement for i in t.plan.destroy),
                                     create=(i.placement for i in t.plan.create))

    def release(self, gpu: str, *, changed: bool) -> None:
        """Let go of the GPU (watchers told when its instances changed)."""
        self._ledger.end_transition(gpu, changed=changed)

    # -- running a plan -------------------------------------------------------------------

    async def run(self, t: Transition, gpu: Gpu, current: Geometry, *, on_demand: bool = False,
                  allow_reset: bool = False,
                  commit: Callable[[], Coroutine[Any, Any, None]] | None = None
                  ) -> TransitionState:
        """Apply ``t.plan`` to ``gpu``, whose fresh walk under its lock is ``current``: the
        journal entry first (durably), each step, a verification, then ``commit`` (the
        caller's record of the result); on any failure, the one failure exit rolls back to
        ``current`` (held instances kept). Returns the terminal state; ``t.error`` and
        ``t.cause`` say what went wrong. A slice (``on_demand``) journals no per-step records
        (its plan names its one instance) and treats a mode change that stays pending as a
        failure."""
        mutator = self._mutator(gpu)
        t.advance(TransitionState.APPLYING)
        try:
            # A slice leaves every other instance as it is: no CI profiles to restore.
            ci_profiles = {} if on_demand else \
                await self._session.mutate(gpu.uuid, mutator.ci_profiles)
            entry = new_entry(transition_id=t.id, gpu=gpu.uuid, old=current,
                              old_ci_profiles=ci_profiles, plan=t.plan, on_demand=on_demand)
            await asyncio.to_thread(self.journal.write, entry)
        except Exception as err:  # nothing touched yet: no journal, no mutation
            t.error, t.cause = f"could not start: {err}", err
            return TransitionState.ABORTED
        try:
            if await self._apply(t, gpu, mutator, entry, on_demand=on_demand,
                                 allow_reset=allow_reset):
                t.advance(TransitionState.VERIFYING)
                check = partial(mutator.verify_changes, t.plan) if on_demand else \
                    partial(mutator.verify, t.plan.target())
                problem = await self._session.mutate(gpu.uuid, check)
                if problem is not None:
                    raise VerifyFailed(problem)
                final = TransitionState.SUCCEEDED
            else:
                final = TransitionState.PENDING_RESET
            if commit is not None:
                await commit()
        except Exception as err:  # the one failure exit: whatever went wrong, roll back
            final = await self.roll_back(t, gpu, entry, err)
        await asyncio.to_thread(self.journal.close, gpu.uuid)
        return final

    async def _step(self, t: Transition, gpu: Gpu, entry: JournalEntry, name: str,
                    action: Callable[[], str], *, journaled: bool = True) -> str:
        """Run one mutation, with its journal records around it when ``journaled``."""
        record = StepRecord(name=name, started_at=time.time())
        t.steps.append(record)
        if journaled:
            entry.next_step = name
            await asyncio.to_thread(self.journal.write, entry)
        try:
            record.result = await self._session.mutate(gpu.uuid, action)
        except Exception as err:
            record.error = str(err)
            raise
        finally:
            record.finished_at = time.time()
        if journaled:
            entry.done.append(name)
            entry.next_step = None
            await asyncio.to_thread(self.journal.write, entry)
        return record.result

    async def _apply(self, t: Transition, gpu: Gpu, mutator: GpuMutator, entry: JournalEntry,
                     *, on_demand: bool, allow_reset: bool) -> bool:
        """Every step of the plan; False when the transition ended ``pending_reset``."""
        for step in steps_of(t.plan):
            await self._step(t, gpu, entry, step.name, partial(mutator.run, step),
                             journaled=not on_demand)
            if step.kind == "destroy_gi":
                self._metrics.mig_instances_destroyed.inc()
            if step.kind == "set_mode" and not await self._mode_took_effect(
                    t, gpu, mutator, bool(step.enable), allow_reset=allow_reset):
                if on_demand:
                    raise ModeStayedPending(t.error)
                return False
        return True

    async def _mode_took_effect(self, t: Transition, gpu: Gpu, mutator: GpuMutator,
                                wanted: bool, *, allow_reset: bool) -> bool:
        if await self._session.mutate(gpu.uuid, mutator.mig_enabled) == wanted:
            return True
        reason = (f"MIG mode change to {'on' if wanted else 'off'} is pending: the GPU must be "
                  "reset (it was not idle, or it is an Ampere GPU)")
        if allow_reset and self._reset_command:
            if await self.processes(gpu):
                reason += "; not reset because processes run on it"
            else:
                await self._reset(t, gpu)
                if await self._session.mutate(gpu.uuid, mutator.mig_enabled) == wanted:
                    return True
                reason += "; still pending after the reset"
        elif not self._reset_command:
            reason += "; no --gpu-reset-command is configured: run 'nvidia-smi -r -i " \
                      f"{gpu.static.pci_bus_id}' on the idle GPU or reboot, and the agent " \
                      "re-applies the geometry at start-up"
        else:
            reason += "; ask with allow_reset to let the agent reset the idle GPU"
        t.error = reason
        return False

    async def _reset(self, t: Transition, gpu: Gpu) -> None:
        assert self._reset_command is not None
        argv = [part.format(pci_bus_id=gpu.static.pci_bus_id, uuid=gpu.uuid, index=gpu.index)
                for part in shlex.split(self._reset_command)]
        record = StepRecord(name="reset GPU", started_at=time.time())
        t.steps.append(record)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), RESET_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            out = f"timed out after {RESET_TIMEOUT_S} s".encode()
        record.finished_at = time.time()
        record.result = f"exit {proc.returncode}: {out.decode(errors='replace')[-300:]}"
        self._events.append("mig.gpu_reset", f"GPU {gpu.index} reset: {record.result}",
                            gpu=gpu.uuid)
        if proc.returncode == 0:
            self._on_reset(gpu.uuid)

    async def roll_back(self, t: Transition, gpu: Gpu, entry: JournalEntry,
                        err: Exception) -> TransitionState:
        """Restore the journal's old geometry, keeping every instance a claim holds; the
        terminal state it leads to (``failed``, with the GPU quarantined, if it cannot)."""
        t.error, t.cause = str(err), err
        t.advance(TransitionState.ROLLING_BACK)
        entry.phase = "rolling_back"
        old = self._with_held(gpu.uuid, entry.old_geometry(), entry.the_plan())
        mutator = self._mutator(gpu)
        try:
            await self._step(t, gpu, entry, f"restore {layout(old)}", partial(
                _restore, mutator, old, entry.old_ci_profiles))
            return TransitionState.ROLLED_BACK
        except Exception as failure:
            await self._ledger.quarantine(
                gpu.uuid, f"rollback of transition {t.id} failed: {failure} (after: {err})")
            t.error = f"{err}; rollback failed: {failure}"
            return TransitionState.FAILED

    def _with_held(self, gpu: str, old: Geometry, plan: Plan) -> Geometry:
        """The geometry a rollback restores: the old one plus every instance a claim holds
        (a held instance wins over an old one it overlaps: a rollback never destroys a held
        device). A hold on an instance the plan itself creates (the slice being made for
        it) is not kept: the failed creation is what is undone."""
        created = {i.placement for i in plan.create}
        held = [Instance(h.profile, h.key.placement) for h in self._ledger.keeping(gpu)
                if h.profile is not None and h.key.placement is not None
                and h.key.placement not in created]
        if not held or not old.mig_enabled:
            return old
        kept = [i for i in old.instances
                if not any(h.placement.overlaps(i.placement) for h in held)]
        return Geometry(mig_enabled=True, instances=(*kept, *(
            h for h in held if h.key not in {i.key for i in kept})))

    # -- slices made on demand ------------------------------------------------------------

    async def make_slice(self, holder: str, gpu: Gpu, profile: str, placement: Placement, *,
                         record: Callable[[], Coroutine[Any, Any, None]]) -> MadeSlice:
        """Make ``profile`` at ``placement`` for ``holder``, who holds it in the ledger:
        under the GPU's lock (refused with :class:`DeviceBusy` while a transition owns the
        GPU), on a fresh walk (:class:`PlacementTaken` if something is there now), after
        ``record`` made the slice durable on the caller's side, as a one-instance transition
        that switches MIG on first where it is off. A failure is rolled back and raised; one
        whose rollback fails quarantines the GPU (:class:`DeviceUnavailable`)."""
        key = DeviceKey(gpu.uuid, placement)
        if not any(h.holder == holder and h.key == key for h in self._ledger.holds(gpu.uuid)):
            raise AssertionError(f"{holder} does not hold {key}: reserve before making")
        made = Instance(profile, placement)
        async with self._ledger.slice_change(gpu.uuid):
            current = await self.geometry(gpu)
            if any(i.placement.overlaps(placement) for i in current.instances):
                raise PlacementTaken(f"GPU {gpu.index} has an instance at "
                                     f"{placement.start}:{placement.size} now")
            await record()
            if not current.mig_enabled:
                await asyncio.to_thread(write_durable, self._mark(gpu.uuid), _MARK, b"{}")
            t = _slice_transition(gpu, holder, f"make {made}", Plan(
                keep=current.instances, destroy=(), create=(made,),
                mig_enabled_before=current.mig_enabled, mig_enabled_after=True))
            final = await self.run(t, gpu, current, on_demand=True)
            if final != TransitionState.SUCCEEDED and not current.mig_enabled:
                await asyncio.to_thread(self._forget, gpu.uuid)
            self._raise_unless_done(t, final, gpu, f"making slice {made} for claim {holder}")
            return await self._session.mutate(gpu.uuid, partial(_made, self._mutator(gpu),
                                                                made))

    async def destroy_slice(self, gpu: Gpu, profile: str, placement: Placement) -> bool:
        """Destroy the slice if it is there (matched by profile and placement, never by a GI
        id alone, which the driver may have reused), waiting for a transition that owns the
        GPU; False when it is already gone. The GPU's last instance gone, MIG is switched off
        again where a slice switched it on (best effort: the slice being gone is what the
        claim needed)."""
        victim = Instance(profile, placement)
        async with self._ledger.slice_change(gpu.uuid, wait=True):
            current = await self.geometry(gpu)
            if not current.mig_enabled:
                await asyncio.to_thread(self._forget, gpu.uuid)
                return False
            gone = next((i for i in current.instances if i.key == victim.key), None)
            if gone is None:
                return False
            keep = tuple(i for i in current.instances if i.key != victim.key)
            t = _slice_transition(gpu, None, f"destroy {victim}", Plan(
                keep=keep, destroy=(gone,), create=(), mig_enabled_before=True,
                mig_enabled_after=True))
            final = await self.run(t, gpu, current, on_demand=True)
            self._raise_unless_done(t, final, gpu, f"destroying slice {victim}")
            if not keep and self._mark(gpu.uuid).is_file():
                await self._switch_off(gpu, Geometry(mig_enabled=True, instances=()))
            return True

    async def _switch_off(self, gpu: Gpu, current: Geometry) -> None:
        t = _slice_transition(gpu, None, "disable MIG after the last slice", Plan(
            keep=(), destroy=(), create=(), mig_enabled_before=True, mig_enabled_after=False))
        if await self.run(t, gpu, current, on_demand=True) == TransitionState.SUCCEEDED:
            await asyncio.to_thread(self._forget, gpu.uuid)
        else:  # MIG merely stays on: the full GPU stays unpublished until an operator acts
            log.warning("MIG not switched off after the last slice",
                        extra={"gpu": gpu.uuid, "error": t.error})

    def _raise_unless_done(self, t: Transition, final: TransitionState, gpu: Gpu,
                           what: str) -> None:
        if final == TransitionState.SUCCEEDED:
            return
        if final == TransitionState.FAILED:
            reason = f"{what} failed and could not be undone: {t.error}"
            raise DeviceUnavailable(f"GPU {gpu.index} is quarantined: {reason}", gpu=gpu.uuid,
                                    reason=reason) from t.cause
        if isinstance(t.cause, ModeStayedPending):
            raise DeviceBusy(f"MIG could not be switched on for a slice on GPU {gpu.index} "
                             f"({t.cause}: processes are running on it)",
                             gpu=gpu.uuid) from t.cause
        if t.cause is not None:
            raise t.cause
        raise AssertionError(f"{what} ended {final.value} without a cause")

    def _mark(self, gpu: str) -> Path:
        return self.journal.directory.parent / "mig-on-for-slices" / gpu

    def _forget(self, gpu: str) -> None:
        path = self._mark(gpu)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            fsync_dir(path.parent)


def _slice_transition(gpu: Gpu, holder: str | None, what: str, plan: Plan) -> Transition:
    """The transition value of a slice (not kept in the transition history)."""
    requested = f"{what} for claim {holder}" if holder else what
    t = Transition(id=f"slice-{uuid.uuid4().hex[:8]}", gpu=gpu.uuid, gpu_index=gpu.index,
                   requested=requested, plan=plan, drain=DrainPolicy())
    t.advance(TransitionState.PLANNED)
    return t


def _made(mutator: GpuMutator, made: Instance) -> MadeSlice:
    """The GI, CI and MIG device UUID of an instance just made (mutation thread)."""
    gi = mutator.instance_at(made)
    if gi is None or not gi.compute_instances:
        raise NotFound(f"the {made} slice is not there on {mutator.gpu} after it was made")
    ci = gi.compute_instances[0]
    device = mig.mig_device_uuid(mutator.session, mutator.session.gpu_handle(mutator.gpu),
                                 mutator.gpu, gi.id, ci.id)
    if device is None:
        raise NotFound(f"MIG device of the {made} slice not enumerated on {mutator.gpu}")
    return MadeSlice(gi.id, ci.id, device)


def _restore(mutator: GpuMutator, old: Geometry, ci_profiles: dict[str, list[int]]) -> str:
    mutator.restore(old, ci_profiles)
    return f"restored {layout(old)}"


def layout(geometry: Geometry) -> str:
    """``MIG on with 3g.40gb@0:4, ...`` or ``MIG off``, for messages."""
    if not geometry.mig_enabled:
        return "MIG off"
    return "MIG on with " + (", ".join(str(i) for i in geometry.instances) or "no instances")
