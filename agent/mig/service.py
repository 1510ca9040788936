"""MIG transitions on a node: one at a time per GPU, GPUs in parallel; draining per instance;
then the plan is run by the one door to the instances (:mod:`agent.mig.devices`: journal,
steps, verification, rollback). The geometry last applied is remembered and drift reported
(:mod:`agent.mig.desired`); open journal entries are resolved at start-up
(:mod:`agent.mig.recovery`). :class:`MigService` is what the rest of the agent asks.

Who holds what, which GPU a transition owns, drain and quarantine marks: all in the per-GPU
ledger (``agent/ledger/``), which claims consult too. A claim's hold blocks every plan that
would destroy its instance, change its GPU's mode or reset it; a whole-GPU hold blocks every
change of its GPU; a rollback keeps every held instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import (
    CheckpointUnusable,
    Conflict,
    GeometryNotPlaceable,
    MigModeNeedsExplicit,
    NotFound,
)
from agent.events import EventLog, Severity
from agent.gpu.inventory import GpuInventory
from agent.gpu.types import Gpu, GpuProcess, Placement
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics
from agent.mig.catalog import catalog_of
from agent.mig.desired import DesiredGeometry
from agent.mig.devices import MigDevices
from agent.mig.geometry import (
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Plan,
)
from agent.mig.history import HISTORY, TransitionHistory
from agent.mig.journal import TransitionJournal
from agent.mig.planner import plan as make_plan
from agent.mig.recovery import Action, MigRecovery
from agent.mig.transition import Blocker, DrainPolicy, Transition, TransitionState

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


class MigService:
    def __init__(self, *, devices: MigDevices, inventory: GpuInventory, events: EventLog,
                 metrics: AgentMetrics, ledger: NodeLedger, state_dir: Path, proc_root: Path,
                 reapply: bool = True) -> None:
        self._devices = devices
        self._events = events
        self._metrics = metrics
        self.ledger = ledger
        self._active: dict[str, Transition] = {}
        self._history = TransitionHistory(state_dir / "mig" / "transitions.json")
        self._tasks: set[asyncio.Task[None]] = set()
        self.applies: OrderedDict[str, ApplyRecord] = OrderedDict()
        self.desired = DesiredGeometry(path=state_dir / "mig" / "desired.json",
                                       devices=devices, inventory=inventory, ledger=ledger,
                                       events=events, metrics=metrics, proc_root=proc_root,
                                       reapply=reapply)
        self._recovery = MigRecovery(devices=devices, inventory=inventory, ledger=ledger,
                                     events=events, remember=self.desired.remember,
                                     started=self._history.remember, finished=self._finish)
        if self._history.problem:
            # Only the record of past transitions is lost: nothing is decided from it.
            events.append("mig.history_unreadable", f"{self._history.problem}; the transition "
                          "history starts empty", severity=Severity.WARNING)

    # -- what other parts of the agent ask ------------------------------------------------

    @property
    def journal(self) -> TransitionJournal:
        return self._devices.journal

    def draining(self, gpu: str) -> frozenset[Placement]:
        """Placements on ``gpu`` a transition destroys or has just created (no new claims,
        not advertised)."""
        return self.ledger.draining(gpu)

    def quarantined(self, gpu: str) -> str | None:
        return self.ledger.quarantined(gpu)

    def drift(self, gpu: str) -> str | None:
        return self.desired.drift(gpu)

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

    async def current(self, gpu: Gpu) -> tuple[Geometry, tuple[GpuProcess, ...]]:
        """The GPU's geometry from a fresh walk, instances in use marked held, and its
        processes."""
        return await self._devices.current(gpu)

    def remember_apply(self, record: ApplyRecord) -> None:
        """Keep a node-wide apply for ``GET /v1/mig/apply/{id}`` (the newest ones only)."""
        self.applies[record.id] = record
        while len(self.applies) > HISTORY:
            self.applies.popitem(last=False)

    # -- start-up, drift and an operator's remedies ----------------------------------------

    async def recover(self) -> None:
        """Resolve every open journal entry (before the agent reports ready)."""
        await self._recovery.recover()

    async def reconcile(self, *, reset: frozenset[str] = frozenset()) -> None:
        """Re-apply the remembered geometry where a reboot, a driver reload or a reset of
        ``reset`` emptied a GPU; report drift."""
        await self.desired.reconcile(self._reapply, reset=reset)

    async def check_drift(self) -> None:
        await self.desired.check_drift()

    async def clear_quarantine(self, gpu: Gpu, who: str) -> str:
        return await self._recovery.clear_quarantine(gpu, who)

    async def resolve_by_hand(self, gpu: Gpu, action: Action, who: str) -> Transition:
        return await self._recovery.resolve_by_hand(gpu, action, who)

    async def _reapply(self, gpu: Gpu, desired: DesiredInstances) -> Outcome:
        return await self.request(gpu, desired, DrainPolicy("fail"), explicit_mode=True)

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
        await self._devices.own(gpu.uuid)
        started = False
        try:
            current, processes = await self._devices.current(gpu)
            plan = self._plan(gpu, current, desired)
            if plan.mode_change and gpu.static.architecture in _RESET_TO_CHANGE_MODE \
                    and not explicit_mode:
                raise MigModeNeedsExplicit(
                    f"GPU {gpu.index} is {gpu.static.architecture.capitalize()}: its MIG mode "
                    "changes only when asked explicitly, since the change needs a GPU reset; "
                    f"send \"mig_enabled\": {str(plan.mig_enabled_after).lower()}",
                    mig_enabled=plan.mig_enabled_after, gpu=gpu.uuid)
            blockers = self._blockers(gpu, plan, processes)
            if dry_run or plan.empty:
                if plan.empty and not dry_run:
                    await self.desired.remember(gpu.uuid, plan.target())
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
            self._devices.name(gpu, transition)
            self._active[gpu.uuid] = transition
            self._history.remember(transition)
            started = True
        finally:
            if not started:
                self._devices.release(gpu.uuid, changed=False)
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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    async def _run(self, t: Transition, gpu: Gpu, current: Geometry, *,
                   allow_reset: bool) -> None:
        """Drive one transition to its terminal state. The terminal state is entered last,
        after the journal is closed and the GPU released, so whoever waits for it may start
        the next transition at once."""
        final: TransitionState | None = None
        try:
            if not await self._drain(t, gpu):
                final = TransitionState.ABORTED
                return
            final = await self._devices.run(
                t, gpu, current, allow_reset=allow_reset,
                commit=lambda: self.desired.remember(gpu.uuid, t.plan.target()))
        finally:
            self._active.pop(gpu.uuid, None)
            self._devices.release(gpu.uuid, changed=final not in (
                None, TransitionState.ABORTED))
            if final is not None:
                t.advance(final)
            self._finish(t)

    async def _drain(self, t: Transition, gpu: Gpu) -> bool:
        """Wait until nothing holds an instance the plan destroys; False when aborted."""
        deadline = time.monotonic() + t.drain.timeout_s
        while True:
            blockers = self._blockers(gpu, t.plan, await self._devices.processes(gpu))
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

    async def close(self) -> None:
        """Stop background work (transitions in flight are abandoned; the journal resolves
        them at the next start)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._history.close()


def _describe(desired: Desired) -> str:
    if isinstance(desired, DesiredInstances):
        return ", ".join(f"{name}@{p.start}:{p.size}" for name, p in desired.instances) or \
            "MIG on, no instances"
    return "MIG off" if isinstance(desired, DesiredDisabled) else str(desired)
