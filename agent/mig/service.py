"""MIG transitions on a node: one at a time per GPU, GPUs in parallel; draining per instance;
the journal written before the first mutation; rollback on failure; recovery at start-up;
the desired geometry remembered and re-applied after a reboot, drift reported, never
overwritten.

Who holds what, which GPU a transition owns, drain and quarantine marks: all in the per-GPU
ledger (``agent/ledger/``), which claims consult too. A claim's hold blocks every plan that
would destroy its instance, change its GPU's mode or reset it; a whole-GPU hold blocks every
change of its GPU; a rollback keeps every held instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from agent.durable import DurableMap
from agent.errors import (
    AgentError,
    CheckpointUnusable,
    Conflict,
    GeometryNotPlaceable,
    NotFound,
)
from agent.events import EventLog, Severity
from agent.gpu import mig
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.types import Gpu, GpuProcess, Placement
from agent.host import boot_id
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics
from agent.mig.catalog import catalog_of
from agent.mig.executor import GpuMutator, steps_of
from agent.mig.geometry import (
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    Plan,
)
from agent.mig.history import HISTORY, TransitionHistory
from agent.mig.journal import ALL_GPUS, JournalEntry, TransitionJournal, new_entry
from agent.mig.planner import plan as make_plan
from agent.mig.transition import (
    Blocker,
    DrainPolicy,
    StepRecord,
    Transition,
    TransitionState,
)

log = logging.getLogger("agent.mig")
DRAIN_POLL_S = 0.1
# Architectures where a MIG mode change means a GPU reset (and can wedge a VM's GPU), so the
# agent changes the mode there only when the caller asks for it in so many words.
_RESET_TO_CHANGE_MODE = frozenset({"ampere"})


@dataclass
class ApplyRecord:
    """A node-wide apply of a mig-parted config: one transition (or none) per GPU."""

    id: str
    label: str
    gpus: list[tuple[str, int, str | None]]  # (uuid, index, transition id or None=unchanged)
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Outcome:
    """What a request led to: the plan, and the transition running it (None when the plan is
    empty or it was a dry run)."""

    plan: Plan
    transition: Transition | None
    blockers: tuple[Blocker, ...] = ()


class VerifyFailed(Exception):
    """After applying, the hardware does not show the planned geometry."""


class MigService:
    def __init__(self, *, session: NvmlSession, inventory: GpuInventory, events: EventLog,
                 metrics: AgentMetrics, ledger: NodeLedger, journal: TransitionJournal,
                 state_dir: Path, proc_root: Path, reset_command: str | None = None,
                 reapply: bool = True,
                 on_reset: Callable[[str], None] = lambda _gpu: None) -> None:
        self._session = session
        #: Told a GPU's UUID after --gpu-reset-command reset it (its XID marks are stale).
        self._on_reset = on_reset
        self._inventory = inventory
        self._events = events
        self._metrics = metrics
        self._proc_root = proc_root
        self._reset_command = reset_command
        self._reapply = reapply
        self.ledger = ledger
        self.journal = journal
        self.desired = DurableMap(state_dir / "mig" / "desired.json",
                                  format="gpu-agent-mig-desired")
        self._active: dict[str, Transition] = {}
        self._history = TransitionHistory(state_dir / "mig" / "transitions.json")
        self._drift: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.applies: OrderedDict[str, ApplyRecord] = OrderedDict()
        if self.desired.problem:
            events.append("mig.state_unreadable", self.desired.problem, severity=Severity.ERROR)
        if self._history.problem:
            # Only the record of past transitions is lost: nothing is decided from it.
            events.append("mig.history_unreadable", f"{self._history.problem}; the transition "
                          "history starts empty", severity=Severity.WARNING)

    # -- what other parts of the agent ask ------------------------------------------------

    def draining(self, gpu: str) -> frozenset[Placement]:
        """Placements on ``gpu`` a transition destroys or has just created (no new claims,
        not advertised)."""
        return self.ledger.draining(gpu)

    def quarantined(self, gpu: str) -> str | None:
        return self.ledger.quarantined(gpu)

    def drift(self, gpu: str) -> str | None:
        return self._drift.get(gpu)

    def transitions(self) -> list[Transition]:
        """Newest first: the running ones and the last finished ones, those from before a
        restart included (agent/mig/history.py)."""
        return self._history.newest_first()

    def transition(self, transition_id: str) -> Transition:
        found = self._history.get(transition_id)
        if found is None:
            raise NotFound(f"no transition {transition_id!r}", transition=transition_id)
        return found

    def active(self, gpu: str) -> Transition | None:
        return self._active.get(gpu)

    # -- reading the GPU ------------------------------------------------------------------

    def _mutator(self, gpu: Gpu) -> GpuMutator:
        return GpuMutator(self._session, gpu.uuid, gpu.profiles)

    async def _processes(self, gpu: Gpu) -> tuple[GpuProcess, ...]:
        def read() -> tuple[GpuProcess, ...]:
            handle = self._session.gpu_handle(gpu.uuid)
            return mig.running_processes(self._session, handle, gpu.uuid)
        return await self._session.read(read)

    async def current(self, gpu: Gpu) -> tuple[Geometry, tuple[GpuProcess, ...]]:
        """The GPU's geometry from a fresh walk, instances in use (by a process or a claim
        in the ledger) marked held, and its processes."""
        processes = await self._processes(gpu)
        busy = sorted({p.gi_id for p in processes if p.gi_id is not None})
        geometry = await self._session.read(partial(self._mutator(gpu).geometry, busy))
        held = [h.key.placement for h in self.ledger.keeping(gpu.uuid)]
        if any(held):
            geometry = Geometry(mig_enabled=geometry.mig_enabled, instances=tuple(
                replace(i, held=True) if any(p is not None and p.overlaps(i.placement)
                                             for p in held) else i
                for i in geometry.instances))
        return geometry, processes

    def _blockers(self, gpu: Gpu, plan: Plan,
                  processes: Sequence[GpuProcess]) -> tuple[Blocker, ...]:
        """What stands in the plan's way: processes and claims on instances it destroys, and
        for a mode change every process and claim on the GPU; a whole-GPU claim blocks any
        change at all."""
        found: list[Blocker] = []
        holds = self.ledger.keeping(gpu.uuid)
        if not plan.empty:
            found += [Blocker("whole GPU", "claim", h.holder) for h in holds
                      if h.key.placement is None]
        for instance in plan.destroy:
            found += [Blocker(str(instance), "process", str(p.pid)) for p in processes
                      if p.gi_id is not None and p.gi_id == instance.gi_id]
            found += [Blocker(str(instance), "claim", h.holder) for h in holds
                      if h.key.placement is not None
                      and h.key.placement.overlaps(instance.placement)]
        if plan.mode_change:
            found += [Blocker("whole GPU", "process", str(p.pid)) for p in processes
                      if p.gi_id is None]
            found += [Blocker("whole GPU", "claim", h.holder) for h in holds
                      if h.key.placement is not None]
        return tuple(dict.fromkeys(found))

    # -- requests -------------------------------------------------------------------------

    async def request(self, gpu: Gpu, desired: Desired, drain: DrainPolicy, *,
                      explicit_mode: bool = False, allow_reset: bool = False,
                      dry_run: bool = False, apply_id: str | None = None) -> Outcome:
        """Plan the change and, unless it is a dry run or already applied, start it."""
        if not gpu.static.mig_capable:
            raise Conflict(f"GPU {gpu.index} ({gpu.static.name}) does not support MIG",
                           gpu=gpu.uuid)
        reason = self.quarantined(gpu.uuid)
        if reason is not None:
            raise Conflict(f"GPU {gpu.index} is quarantined: {reason}", gpu=gpu.uuid)
        if self.ledger.frozen is not None and not dry_run:
            raise CheckpointUnusable(
                f"{self.ledger.frozen}; MIG geometry changes are refused meanwhile, since which "
                "instances claims hold is unknown")
        await self.ledger.begin_transition(gpu.uuid)
        started = False
        try:
            current, processes = await self.current(gpu)
            plan = self._plan(gpu, current, desired)
            if plan.mode_change and gpu.static.architecture in _RESET_TO_CHANGE_MODE \
                    and not explicit_mode:
                raise Conflict(
                    f"GPU {gpu.index} is {gpu.static.architecture.capitalize()}: its MIG mode "
                    "changes only when asked explicitly, since the change needs a GPU reset; "
                    f"send \"mig_enabled\": {str(plan.mig_enabled_after).lower()}",
                    gpu=gpu.uuid)
            blockers = self._blockers(gpu, plan, processes)
            if dry_run or plan.empty:
                if plan.empty and not dry_run:
                    await self._remember(gpu.uuid, plan.target())
                return Outcome(plan, None, blockers)
            if blockers and drain.policy == "fail":
                raise Conflict(
                    f"instances the plan destroys are in use: "
                    f"{', '.join(f'{b.instance} by {b.kind} {b.id}' for b in blockers)}; "
                    "drain them, or ask with drain policy 'wait'",
                    gpu=gpu.uuid, blockers=[b.__dict__ for b in blockers])
            transition = Transition(id=uuid.uuid4().hex[:12], gpu=gpu.uuid,
                                    gpu_index=gpu.index, requested=_describe(desired),
                                    plan=plan, drain=drain, apply_id=apply_id)
            transition.advance(TransitionState.PLANNED)
            transition.blockers = list(blockers)
            self.ledger.name_transition(gpu.uuid, transition.id,
                                        drain=(i.placement for i in plan.destroy),
                                        create=(i.placement for i in plan.create))
            self._active[gpu.uuid] = transition
            self._remember_transition(transition)
            started = True
        finally:
            if not started:
                self.ledger.end_transition(gpu.uuid, changed=False)
        self._events.append("mig.transition.planned", f"GPU {gpu.index}: {plan.summary()}",
                            gpu=gpu.uuid, details={"transition": transition.id})
        self._spawn(self._run(transition, gpu, current, allow_reset=allow_reset))
        return Outcome(plan, transition, blockers)

    async def cancel(self, transition_id: str) -> Transition:
        """Cancel a transition still draining (it then ends ``aborted``, nothing changed)."""
        transition = self.transition(transition_id)
        if transition.state.terminal:
            return transition
        if transition.state not in (TransitionState.PLANNED, TransitionState.DRAINING):
            raise Conflict(f"transition {transition_id} is {transition.state.value}: it can be "
                           "cancelled only before it starts changing the GPU; it will finish "
                           "or roll back", transition=transition_id)
        transition.cancel_requested.set()
        await transition.finished.wait()
        return transition

    # -- running a transition --------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def remember_apply(self, record: ApplyRecord) -> None:
        """Keep a node-wide apply for ``GET /v1/mig/apply/{id}`` (the newest ones only)."""
        self.applies[record.id] = record
        while len(self.applies) > HISTORY:
            self.applies.popitem(last=False)

    def _remember_transition(self, transition: Transition) -> None:
        self._history.remember(transition)

    def _plan(self, gpu: Gpu, current: Geometry, desired: Desired) -> Plan:
        """The plan to ``desired`` that keeps the claims' slices besides; when they cannot
        stay, the plan to ``desired`` alone (its holders then block it, or are waited for)."""
        catalog = catalog_of(gpu.profiles)
        with_slices = self._with_slices(gpu.uuid, desired)
        if with_slices is desired:
            return make_plan(catalog, current, desired)
        try:
            return make_plan(catalog, current, with_slices)
        except GeometryNotPlaceable:
            return make_plan(catalog, current, desired)

    def _with_slices(self, gpu: str, desired: Desired) -> Desired:
        """The desired geometry plus the claims' on-demand slices where they are: a slice is
        the claim's, not part of the node's geometry, so it never stands in for a profile the
        caller asked for (a MIG-off request keeps none: its holders block it instead)."""
        slices = sorted(self.ledger.on_demand(gpu), key=lambda s: (s[1].start, s[0]))
        if not slices or isinstance(desired, DesiredDisabled):
            return desired
        if isinstance(desired, DesiredProfiles):
            return DesiredProfiles(Counter(desired.multiset()) + Counter(p for p, _ in slices))
        listed = set(desired.instances)
        return DesiredInstances((*desired.instances, *(s for s in slices if s not in listed)))

    def _static(self, gpu: str, geometry: Geometry) -> Geometry:
        """The geometry without the claims' on-demand slices."""
        dynamic = self.ledger.on_demand(gpu)
        if not dynamic:
            return geometry
        return Geometry(mig_enabled=geometry.mig_enabled, instances=tuple(
            i for i in geometry.instances if (i.profile, i.placement) not in dynamic))

    async def _remember(self, gpu: str, target: Geometry) -> None:
        await self.desired.set(gpu, {"geometry": self._static(gpu, target).to_dict(),
                                     "boot_id": boot_id(self._proc_root)})
        self._clear_drift(gpu)

    async def _run(self, t: Transition, gpu: Gpu, current: Geometry, *,
                   allow_reset: bool) -> None:
        """Drive one transition to its terminal state. The terminal state is entered last,
        after the journal is closed and the GPU released, so whoever waits for it may start
        the next transition at once."""
        mutator = self._mutator(gpu)
        final: TransitionState | None = None
        try:
            if not await self._drain(t, gpu):
                final = TransitionState.ABORTED
                return
            t.advance(TransitionState.APPLYING)
            try:
                ci_profiles = await self._session.mutate(gpu.uuid, mutator.ci_profiles)
                entry = new_entry(transition_id=t.id, gpu=gpu.uuid, old=current,
                                  old_ci_profiles=ci_profiles, plan=t.plan)
                await asyncio.to_thread(self.journal.write, entry)
            except Exception as err:  # nothing touched yet: no journal, no mutation
                t.error = f"could not start: {err}"
                final = TransitionState.ABORTED
                return
            try:
                if await self._apply(t, gpu, mutator, entry, allow_reset=allow_reset):
                    t.advance(TransitionState.VERIFYING)
                    problem = await self._session.mutate(gpu.uuid, partial(
                        mutator.verify, t.plan.target()))
                    if problem is not None:
                        raise VerifyFailed(problem)
                    final = TransitionState.SUCCEEDED
                else:
                    final = TransitionState.PENDING_RESET
                await self._remember(gpu.uuid, t.plan.target())
            except Exception as err:  # the one failure exit: whatever went wrong, roll back
                final = await self._roll_back(t, gpu, mutator, entry, err)
            await asyncio.to_thread(self.journal.close, gpu.uuid)
        finally:
            self._active.pop(gpu.uuid, None)
            self.ledger.end_transition(gpu.uuid, changed=final not in (
                None, TransitionState.ABORTED))
            if final is not None:
                t.advance(final)
            self._finish(t)

    async def _drain(self, t: Transition, gpu: Gpu) -> bool:
        """Wait until nothing holds an instance the plan destroys; False when aborted."""
        deadline = time.monotonic() + t.drain.timeout_s
        while True:
            blockers = self._blockers(gpu, t.plan, await self._processes(gpu))
            t.blockers = list(blockers)
            if not blockers:
                return True
            if t.state != TransitionState.DRAINING:
                t.advance(TransitionState.DRAINING)
            if t.cancel_requested.is_set() or time.monotonic() >= deadline:
                why = "cancelled" if t.cancel_requested.is_set() else \
                    f"drain timed out after {t.drain.timeout_s:g}s"
                t.error = f"{why}; still in use: " + ", ".join(
                    f"{b.instance} by {b.kind} {b.id}" for b in blockers)
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(t.cancel_requested.wait(),
                                       min(DRAIN_POLL_S, max(deadline - time.monotonic(), 0)))

    async def _step(self, t: Transition, gpu: Gpu, entry: JournalEntry,
                    name: str, action: Callable[[], str]) -> str:
        """Run one mutation with its journal records around it."""
        record = StepRecord(name=name, started_at=time.time())
        t.steps.append(record)
        entry.next_step = name
        await asyncio.to_thread(self.journal.write, entry)
        try:
            record.result = await self._session.mutate(gpu.uuid, action)
        except Exception as err:
            record.error = str(err)
            raise
        finally:
            record.finished_at = time.time()
        entry.done.append(name)
        entry.next_step = None
        await asyncio.to_thread(self.journal.write, entry)
        return record.result

    async def _apply(self, t: Transition, gpu: Gpu, mutator: GpuMutator, entry: JournalEntry,
                     *, allow_reset: bool) -> bool:
        """Every step of the plan; False when the transition ended ``pending_reset``."""
        for step in steps_of(t.plan):
            await self._step(t, gpu, entry, step.name, partial(mutator.run, step))
            if step.kind == "destroy_gi":
                self._metrics.mig_instances_destroyed.inc()
            if step.kind == "set_mode" and not await self._mode_took_effect(
                    t, gpu, mutator, bool(step.enable), allow_reset=allow_reset):
                return False
        return True

    async def _mode_took_effect(self, t: Transition, gpu: Gpu, mutator: GpuMutator,
                                wanted: bool, *, allow_reset: bool) -> bool:
        if await self._session.mutate(gpu.uuid, mutator.mig_enabled) == wanted:
            return True
        reason = (f"MIG mode change to {'on' if wanted else 'off'} is pending: the GPU must be "
                  "reset (it was not idle, or it is an Ampere GPU)")
        if allow_reset and self._reset_command:
            if await self._processes(gpu):
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
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
        except TimeoutError:
            proc.kill()
            out = b"timed out after 120 s"
        record.finished_at = time.time()
        record.result = f"exit {proc.returncode}: {out.decode(errors='replace')[-300:]}"
        self._events.append("mig.gpu_reset", f"GPU {gpu.index} reset: {record.result}",
                            gpu=gpu.uuid)
        if proc.returncode == 0:
            self._on_reset(gpu.uuid)

    async def _roll_back(self, t: Transition, gpu: Gpu, mutator: GpuMutator,
                         entry: JournalEntry, err: Exception) -> TransitionState:
        """Restore the recorded old geometry; the terminal state it leads to."""
        t.error = str(err)
        t.advance(TransitionState.ROLLING_BACK)
        entry.phase = "rolling_back"
        old = self._with_held(gpu.uuid, entry.old_geometry())
        try:
            await self._step(t, gpu, entry, f"restore {_layout(old)}", partial(
                _restore, mutator, old, entry.old_ci_profiles))
            return TransitionState.ROLLED_BACK
        except Exception as failure:
            await self._quarantine(gpu.uuid, gpu.index, f"rollback of transition {t.id} "
                                   f"failed: {failure} (after: {err})")
            t.error = f"{err}; rollback failed: {failure}"
            return TransitionState.FAILED

    def _with_held(self, gpu: str, old: Geometry) -> Geometry:
        """The geometry a rollback restores: the old one plus every instance a claim holds
        (a held instance wins over an old one it overlaps: a rollback never destroys a held
        device)."""
        held = [Instance(h.profile, h.key.placement) for h in self.ledger.keeping(gpu)
                if h.profile is not None and h.key.placement is not None]
        if not held or not old.mig_enabled:
            return old
        kept = [i for i in old.instances
                if not any(h.placement.overlaps(i.placement) for h in held)]
        return Geometry(mig_enabled=True, instances=(*kept, *(
            h for h in held if h.key not in {i.key for i in kept})))

    async def _quarantine(self, gpu: str, index: int, reason: str) -> None:
        try:
            await self.ledger.quarantine(gpu, reason)
        finally:
            self._events.append(
            "mig.quarantined",
                f"GPU {index} quarantined: {reason}. Operator: compare 'nvidia-smi mig -lgi' "
                "with GET /v1/gpus/{gpu}/mig, restore or clear the layout by hand, then clear "
                "the quarantine", severity=Severity.ERROR, gpu=gpu)

    def _finish(self, t: Transition) -> None:
        result = t.state.value
        if t.state.terminal:
            self._history.finished(t)
            self._metrics.mig_transitions.labels(result).inc()
            if t.duration_s is not None:
                self._metrics.mig_transition_duration.observe(t.duration_s)
        severity = Severity.INFO if t.state in (TransitionState.SUCCEEDED,
                                                TransitionState.ABORTED) else Severity.ERROR
        self._events.append(f"mig.transition.{result}",
                            f"GPU {t.gpu_index}: transition {t.id} {result}"
                            + (f": {t.error}" if t.error else ""), severity=severity,
                            gpu=t.gpu, details={"transition": t.id, "plan": t.plan.summary()})

    # -- start-up -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Resolve every open journal entry before the agent reports ready: finish when the
        hardware already shows the target, else roll back to the recorded old geometry."""
        entries, corrupt = await asyncio.to_thread(self.journal.open_entries)
        for bad in corrupt:
            # The journal directory itself was unreadable: any GPU may be half-changed.
            suspects = ([g for g in self._inventory.gpus if g.static.mig_capable]
                        if bad.gpu == ALL_GPUS else [self._gpu_or_none(bad.gpu)])
            for gpu in suspects:
                await self._quarantine(gpu.uuid if gpu else bad.gpu, gpu.index if gpu else -1,
                                       f"journal entry unreadable ({bad.reason}), kept at "
                                       f"{bad.kept_at}; the geometry may be half-changed")
        for entry in entries:
            await self.ledger.begin_transition(entry.gpu)
            changed = False
            try:
                changed = await self._recover_entry(entry)
            except AgentError as err:
                # A GPU that cannot be reached (lost) keeps its entry for the next start; the
                # node still becomes ready, with that GPU reported unavailable.
                self._events.append("mig.recovery_failed", f"GPU {entry.gpu}: the open "
                                    f"transition {entry.transition_id} could not be resolved: "
                                    f"{err.detail}; it is resolved at the next start",
                                    severity=Severity.ERROR, gpu=entry.gpu)
            finally:
                self.ledger.end_transition(entry.gpu, changed=changed)

    def _gpu_or_none(self, uuid_: str) -> Gpu | None:
        return next((g for g in self._inventory.gpus if g.uuid == uuid_), None)

    async def _recover_entry(self, entry: JournalEntry) -> bool:
        gpu = self._gpu_or_none(entry.gpu)
        if gpu is None:
            self._events.append("mig.recovery", f"journal entry for unknown GPU {entry.gpu} "
                                "dropped", severity=Severity.WARNING, gpu=entry.gpu)
            await asyncio.to_thread(self.journal.close, entry.gpu)
            return False
        plan = entry.the_plan()
        t = Transition(id=entry.transition_id, gpu=gpu.uuid, gpu_index=gpu.index,
                       requested="recovery after restart", plan=plan, drain=DrainPolicy())
        self._remember_transition(t)
        mutator = self._mutator(gpu)
        problem = await self._session.mutate(gpu.uuid, partial(mutator.verify, plan.target()))
        if problem is None:
            if not entry.on_demand:
                await self._remember(gpu.uuid, plan.target())
            t.error = "finished at start-up: the hardware already showed the target"
            final = TransitionState.SUCCEEDED
        else:
            final = await self._roll_back(t, gpu, mutator, entry, VerifyFailed(
                f"interrupted at {entry.next_step or 'a step boundary'} "
                f"(phase {entry.phase}); {problem}"))
        await asyncio.to_thread(self.journal.close, gpu.uuid)
        t.advance(final)
        self._finish(t)
        return True

    # -- operator remediation ---------------------------------------------------------------

    async def clear_quarantine(self, gpu: Gpu, who: str) -> str:
        """Lift the quarantine after an operator restored or cleared the layout by hand;
        returns the reason it was quarantined."""
        reason = await self.ledger.clear_quarantine(gpu.uuid)
        self._events.append("mig.quarantine_cleared", f"GPU {gpu.index}: quarantine cleared by "
                            f"{who} (was: {reason})", severity=Severity.WARNING, gpu=gpu.uuid)
        return reason

    async def resolve_by_hand(self, gpu: Gpu, action: str, who: str) -> Transition:
        """Resolve the GPU's open journal entry as recovery at start-up would, but with the
        operator's choice: ``roll-back`` restores the recorded old geometry, ``finish`` accepts
        the target only if the hardware shows it."""
        if self.ledger.busy(gpu.uuid) is not None:
            raise Conflict(f"GPU {gpu.index} has a transition in progress; wait for it or "
                           "cancel it", gpu=gpu.uuid)
        await self.ledger.begin_transition(gpu.uuid)
        try:
            entries, corrupt = await asyncio.to_thread(self.journal.open_entries)
            for bad in corrupt:
                await self._quarantine(bad.gpu, gpu.index if bad.gpu == gpu.uuid else -1,
                                       f"journal entry unreadable ({bad.reason}), kept at "
                                       f"{bad.kept_at}; the geometry may be half-changed")
            entry = next((e for e in entries if e.gpu == gpu.uuid), None)
            if entry is None:
                raise NotFound(f"GPU {gpu.index} has no open journal entry: nothing to resolve "
                               "(a quarantined GPU is released with clear-quarantine)",
                               gpu=gpu.uuid)
            plan = entry.the_plan()
            t = Transition(id=entry.transition_id, gpu=gpu.uuid, gpu_index=gpu.index,
                           requested=f"resolved by hand ({action}) by {who}", plan=plan,
                           drain=DrainPolicy())
            self._remember_transition(t)
            mutator = self._mutator(gpu)
            if action == "finish":
                problem = await self._session.mutate(gpu.uuid, partial(mutator.verify,
                                                                       plan.target()))
                if problem is not None:
                    raise Conflict(f"GPU {gpu.index} does not show the target of transition "
                                   f"{t.id}: {problem}; roll back instead", gpu=gpu.uuid)
                await self._remember(gpu.uuid, plan.target())
                final = TransitionState.SUCCEEDED
            else:
                final = await self._roll_back(t, gpu, mutator, entry,
                                              VerifyFailed(f"rolled back by hand by {who}"))
            await asyncio.to_thread(self.journal.close, gpu.uuid)
        finally:
            self.ledger.end_transition(gpu.uuid, changed=True)
        t.advance(final)
        self._finish(t)
        return t

    async def reconcile(self) -> None:
        """Compare each GPU with the geometry last applied: re-apply after a reboot or driver
        reload emptied it; report (never overwrite) a change made behind the agent's back."""
        for gpu in self._inventory.gpus:
            record = self.desired.get(gpu.uuid)
            if not gpu.static.mig_capable or record is None or self.quarantined(gpu.uuid):
                continue
            want = Geometry.from_dict(record["geometry"])
            actual = self._static(gpu.uuid, (await self.current(gpu))[0])
            if actual.mig_enabled == want.mig_enabled and actual.same_layout(want):
                self._clear_drift(gpu.uuid)
                continue
            rebooted = record.get("boot_id") != boot_id(self._proc_root)
            if rebooted and not actual.instances and self._reapply:
                self._events.append("mig.reapply", f"GPU {gpu.index}: the node rebooted or "
                                    f"the driver reloaded; re-applying {_layout(want)}",
                                    gpu=gpu.uuid)
                desired = DesiredInstances(tuple((i.profile, i.placement)
                                                 for i in want.instances))
                try:
                    await self.request(gpu, desired, DrainPolicy("fail"), explicit_mode=True)
                except (Conflict, GeometryNotPlaceable, CheckpointUnusable) as err:
                    self._set_drift(gpu, f"re-applying failed: {err.detail}")
                continue
            self._set_drift(gpu, f"hardware shows {_layout(actual)}, the agent last applied "
                                 f"{_layout(want)}; left as it is")

    async def check_drift(self) -> None:
        """The periodic part of :meth:`reconcile`: report GPUs changed behind our back."""
        for gpu in self._inventory.gpus:
            record = self.desired.get(gpu.uuid)
            if record is None or self.ledger.busy(gpu.uuid) or not gpu.static.mig_capable:
                continue
            want = Geometry.from_dict(record["geometry"])
            actual = self._static(gpu.uuid, (await self.current(gpu))[0])
            if actual.mig_enabled == want.mig_enabled and actual.same_layout(want):
                self._clear_drift(gpu.uuid)
            else:
                self._set_drift(gpu, f"hardware shows {_layout(actual)}, the agent last "
                                     f"applied {_layout(want)}; left as it is")

    def _set_drift(self, gpu: Gpu, reason: str) -> None:
        self._metrics.mig_geometry_drift.labels(gpu.uuid).set(1)
        if self._drift.get(gpu.uuid) != reason:
            self._drift[gpu.uuid] = reason
            self._events.append("mig.drift", f"GPU {gpu.index}: MIG geometry changed behind "
                                f"the agent's back: {reason}", severity=Severity.WARNING,
                                gpu=gpu.uuid)

    def _clear_drift(self, gpu: str) -> None:
        self._metrics.mig_geometry_drift.labels(gpu).set(0)
        self._drift.pop(gpu, None)

    async def close(self) -> None:
        """Stop background work (transitions in flight are abandoned; the journal resolves
        them at the next start)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._history.close()


def _restore(mutator: GpuMutator, old: Geometry, ci_profiles: dict[str, list[int]]) -> str:
    mutator.restore(old, ci_profiles)
    return f"restored {_layout(old)}"


def _layout(geometry: Geometry) -> str:
    if not geometry.mig_enabled:
        return "MIG off"
    return "MIG on with " + (", ".join(str(i) for i in geometry.instances) or "no instances")


def _describe(desired: Desired) -> str:
    if isinstance(desired, DesiredInstances):
        return ", ".join(f"{name}@{p.start}:{p.size}" for name, p in desired.instances) or \
            "MIG on, no instances"
    return "MIG off" if isinstance(desired, DesiredDisabled) else str(desired)

