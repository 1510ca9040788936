"""Resolving the transitions the journal says were in flight: at start-up, before the agent is
ready (finish when the hardware already shows the target, else roll back to the recorded old
geometry), and by an operator's hand afterwards; and lifting a quarantine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from agent.errors import AgentError, Conflict, NotFound
from agent.events import EventLog, Severity
from agent.gpu.inventory import GpuInventory
from agent.gpu.types import Gpu
from agent.ledger.ledger import NodeLedger
from agent.mig.devices import MigDevices, VerifyFailed
from agent.mig.geometry import Geometry
from agent.mig.journal import ALL_GPUS, CorruptEntry, JournalEntry
from agent.mig.transition import DrainPolicy, Transition, TransitionState

Action = Literal["roll-back", "finish"]


class MigRecovery:
    """The journal's open entries, resolved through the one door to the instances."""

    def __init__(self, *, devices: MigDevices, inventory: GpuInventory, ledger: NodeLedger,
                 events: EventLog, remember: Callable[[str, Geometry], Awaitable[None]],
                 started: Callable[[Transition], None],
                 finished: Callable[[Transition], None]) -> None:
        self._devices = devices
        self._journal = devices.journal
        self._inventory = inventory
        self._ledger = ledger
        self._events = events
        #: The desired geometry's :meth:`remember` (a finished change is what the GPU shows).
        self._remember = remember
        #: Record a transition in the history, and report its end (history, metric, event).
        self._started = started
        self._finished = finished

    async def recover(self) -> None:
        """Resolve every open journal entry before the agent reports ready."""
        entries, corrupt = await asyncio.to_thread(self._journal.open_entries)
        for bad in corrupt:
            # The journal directory itself was unreadable: any GPU may be half-changed.
            suspects = ([g.uuid for g in self._inventory.gpus if g.static.mig_capable]
                        if bad.gpu == ALL_GPUS else [bad.gpu])
            for gpu in suspects:
                await self._quarantine_unreadable(gpu, bad)
        for entry in entries:
            await self._devices.own(entry.gpu)
            changed = False
            try:
                changed = await self._recover(entry)
            except AgentError as err:
                # A GPU that cannot be reached (lost) keeps its entry for the next start; the
                # node still becomes ready, with that GPU reported unavailable.
                self._events.append("mig.recovery_failed", f"GPU {entry.gpu}: the open "
                                    f"transition {entry.transition_id} could not be resolved: "
                                    f"{err.detail}; it is resolved at the next start",
                                    severity=Severity.ERROR, gpu=entry.gpu)
            finally:
                self._devices.release(entry.gpu, changed=changed)

    async def _quarantine_unreadable(self, gpu: str, bad: CorruptEntry) -> None:
        await self._ledger.quarantine(gpu, f"journal entry unreadable ({bad.reason}), kept at "
                                      f"{bad.kept_at}; the geometry may be half-changed")

    def _gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self._inventory.gpus if g.uuid == uuid), None)

    async def _recover(self, entry: JournalEntry) -> bool:
        gpu = self._gpu(entry.gpu)
        if gpu is None:
            self._events.append("mig.recovery", f"journal entry for unknown GPU {entry.gpu} "
                                "dropped", severity=Severity.WARNING, gpu=entry.gpu)
            await asyncio.to_thread(self._journal.close, entry.gpu)
            return False
        t = self._transition(gpu, entry, "recovery after restart")
        problem = await self._devices.verify(gpu, t.plan.target())
        if problem is None:
            if not entry.on_demand:
                await self._remember(gpu.uuid, t.plan.target())
            t.error = "finished at start-up: the hardware already showed the target"
            final = TransitionState.SUCCEEDED
        else:
            final = await self._devices.roll_back(t, gpu, entry, VerifyFailed(
                f"interrupted at {entry.next_step or 'a step boundary'} "
                f"(phase {entry.phase}); {problem}"))
        await asyncio.to_thread(self._journal.close, gpu.uuid)
        t.advance(final)
        self._finished(t)
        return True

    def _transition(self, gpu: Gpu, entry: JournalEntry, requested: str) -> Transition:
        t = Transition(id=entry.transition_id, gpu=gpu.uuid, gpu_index=gpu.index,
                       requested=requested, plan=entry.the_plan(), drain=DrainPolicy())
        self._started(t)
        return t

    async def resolve_by_hand(self, gpu: Gpu, action: Action, who: str) -> Transition:
        """Resolve the GPU's open journal entry as recovery at start-up would, but with the
        operator's choice: ``roll-back`` restores the recorded old geometry, ``finish`` accepts
        the target only if the hardware shows it."""
        if self._ledger.busy(gpu.uuid) is not None:
            raise Conflict(f"GPU {gpu.index} has a transition in progress; wait for it or "
                           "cancel it", gpu=gpu.uuid)
        await self._devices.own(gpu.uuid)
        try:
            entries, corrupt = await asyncio.to_thread(self._journal.open_entries)
            for bad in corrupt:
                await self._quarantine_unreadable(bad.gpu, bad)
            entry = next((e for e in entries if e.gpu == gpu.uuid), None)
            if entry is None:
                raise NotFound(f"GPU {gpu.index} has no open journal entry: nothing to resolve "
                               "(a quarantined GPU is released with clear-quarantine)",
                               gpu=gpu.uuid)
            t = self._transition(gpu, entry, f"resolved by hand ({action}) by {who}")
            if action == "finish":
                problem = await self._devices.verify(gpu, t.plan.target())
                if problem is not None:
                    raise Conflict(f"GPU {gpu.index} does not show the target of transition "
                                   f"{t.id}: {problem}; roll back instead", gpu=gpu.uuid)
                await self._remember(gpu.uuid, t.plan.target())
                final = TransitionState.SUCCEEDED
            else:
                final = await self._devices.roll_back(
                    t, gpu, entry, VerifyFailed(f"rolled back by hand by {who}"))
            await asyncio.to_thread(self._journal.close, gpu.uuid)
        finally:
            self._devices.release(gpu.uuid, changed=True)
        t.advance(final)
        self._finished(t)
        return t

    async def clear_quarantine(self, gpu: Gpu, who: str) -> str:
        """Lift the quarantine after an operator restored or cleared the layout by hand;
        returns the reason it was quarantined."""
        reason = await self._ledger.clear_quarantine(gpu.uuid)
        self._events.append("mig.quarantine_cleared", f"GPU {gpu.index}: quarantine cleared by "
                            f"{who} (was: {reason})", severity=Severity.WARNING, gpu=gpu.uuid)
        return reason
