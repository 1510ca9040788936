"""ResourceSlices of this node, rendered on request from the inventory, the ledger's
availability, holds and marks, and the topology, with the pool generation kept in
``<state>/dra/pool.json``.

Change notification for the publisher: every answer carries an ETag (a digest of the items),
and :meth:`ResourceSliceService.wait_for_change` holds a caller until the content differs. While
anyone waits, one watcher task serves them all: the ledger's watchers wake it at once after
a geometry change (it then re-reads the inventory); holds, drain marks and every GPU's
faults (XIDs, lost, unmonitored, quarantine, an operator's drain: the devices' taints) are
in-memory state it compares every ``poll_s`` (no NVML call, a few GpuFacts compared), so a
taint appears and goes within the 2 s republish goal; and it re-reads the inventory every
``refresh_s`` for changes made behind the agent's back (the NVLink fabric's among them: its
taints and the ``fabricClique`` attribute follow within that). Nothing runs while nobody waits.

The last item is the node's compute-domain slot when it offers one (``domain_slot.py``): a
slice of its own pool with ``spec.nodeSelector`` instead of ``nodeName``, which the kubelet
plugin publishes apart from the GPUs' pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from agent.dra import rules
from agent.dra.domain_slot import render_slot
from agent.dra.generation import PoolGeneration, fingerprint
from agent.dra.resource_slices import DEFAULT_DRIVER, GpuFacts, RenderOptions, render
from agent.errors import AgentError, SlicesInvalid
from agent.gpu.inventory import GpuInventory
from agent.health.taints import Fault
from agent.ledger.ledger import NodeLedger
from agent.topology.service import TopologyService

log = logging.getLogger("agent.dra")


@dataclass(frozen=True)
class Rendered:
    """One answer: the slices, their ETag (quoted, as HTTP sends it) and the facts they were
    rendered from."""

    items: list[dict[str, Any]]
    etag: str
    facts: tuple[GpuFacts, ...]


class ResourceSliceService:
    def __init__(self, *, inventory: GpuInventory, topology: TopologyService,
                 ledger: NodeLedger, state_dir: Path, node_name: str,
                 driver: str = DEFAULT_DRIVER, dynamic_mig: bool = False,
                 gpu_shares: bool = False, poll_s: float = 0.5, refresh_s: float = 10.0,
                 identity: Callable[[str], tuple[str, int] | None] = lambda _: None) -> None:
        self._inventory = inventory
        self._topology = topology
        self._ledger = ledger
        self.node_name = node_name
        self.driver = driver
        self.dynamic_mig = dynamic_mig
        self.gpu_shares = gpu_shares
        self.generation = PoolGeneration(state_dir / "dra" / "pool.json")
        self._poll_s = poll_s
        self._refresh_s = refresh_s
        self._wake = asyncio.Event()
        self._stale: set[str] = set()  # GPUs whose geometry changed: to be read again
        self._changes = asyncio.Condition()
        self._ticks = 0  # counts the watcher's observed changes
        self._latest: tuple[GpuFacts, ...] | None = None
        self._marks: tuple[tuple[str | None, tuple[Fault, ...]], ...] = ()
        #: (UUID, minor) of a GPU lost before this start, as the health state remembers it.
        self._identity = identity
        self._waiters = 0
        self._watcher: asyncio.Task[None] | None = None
        self._released = False
        ledger.watchers.append(self._geometry_changed)

    def facts(self) -> list[GpuFacts]:
        """Every GPU of the last inventory snapshot, with its faults, the agent's marks, the
        claims' holds and the topology. A GPU lost before this start is named as it was
        (UUID, minor) where the health state remembers it, so its device stays published
        with its taint."""
        graph = self._topology.graph
        islands = graph.islands()
        found = []
        for gpu in self._inventory.gpus:
            node = graph.gpus[gpu.index] if gpu.index < graph.size else None
            island = next((members for members in islands if gpu.index in members), None)
            faults = self._ledger.faults(gpu)
            # A monitoring tool's admin-access hold takes nothing from anyone: it hides
            # nothing.
            holds = [h for h in self._ledger.holds(gpu.uuid) if not h.admin]
            shown = gpu
            if gpu.static.minor < 0:
                known = self._identity(gpu.uuid)
                if known is not None:
                    shown = replace(gpu, static=replace(gpu.static, uuid=known[0],
                                                        minor=known[1]))
            found.append(GpuFacts(
                gpu=shown,
                draining=self._ledger.draining(gpu.uuid),
                held=frozenset((h.profile, h.key.placement) for h in holds
                               if h.key.placement is not None),
                held_whole=any(h.key.placement is None for h in holds),
                faults=faults,
                nvlink_island=graph.gpus[island[0]].uuid if island else None,
                nvlink_gb_s=round(node.nvlink_gb_s) if node else 0,
                pcie_root=node.pcie_root if node else None))
        return found

    async def of_version(self, kubernetes: tuple[int, int]) -> list[dict[str, Any]]:
        """The pool for a Kubernetes version, from a fresh inventory read."""
        return (await self.render(kubernetes)).items

    async def render(self, kubernetes: tuple[int, int], *, refresh: bool = True) -> Rendered:
        """The pool for a Kubernetes version with its ETag (``refresh``: from a fresh
        inventory read, else from the last snapshot). :class:`SlicesInvalid` when the
        result would break the server's rules."""
        if refresh:
            await self._inventory.refresh()
        facts = self.facts()
        driver = self._inventory.driver
        content = render(facts, driver, self._options((1, 35), generation=0))
        generation = await self.generation.for_content(fingerprint(content))
        slices = render(facts, driver, self._options(kubernetes, generation=generation))
        # The compute-domain slot is a pool of its own (selected by node label), after the
        # GPUs' slices: it takes no part in their generation.
        slot = render_slot(facts, driver=self.driver, node_name=self.node_name)
        if slot is not None:
            slices.append(slot)
        problems = rules.check(slices, kubernetes)
        if problems:
            # A slice the API server would refuse must never leave the agent.
            log.error("resourceslices invalid", extra={"problems": "; ".join(problems[:5])})
            raise SlicesInvalid("rendered ResourceSlices break Kubernetes validation rules: "
                                + "; ".join(problems[:5]), problems=problems)
        return Rendered(slices, f'"{fingerprint(slices)[:32]}"', tuple(facts))

    async def wait_for_change(self, kubernetes: tuple[int, int], since: Rendered,
                              wait_s: float) -> Rendered | None:
        """The pool once its content differs from ``since`` (rendered for the same version),
        or None after ``wait_s`` seconds without a change (at once after :meth:`release`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        mine = since.facts
        self._waiters += 1
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="resourceslices-watch")
        try:
            while not self._released:
                latest = self._latest
                if latest is not None and latest != mine:
                    current = await self.render(kubernetes, refresh=False)
                    if current.etag != since.etag:
                        return current
                    mine = current.facts  # a change that leaves this version's slices alone
                async with self._changes:
                    seen = self._ticks
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return None
                    try:
                        await asyncio.wait_for(
                            self._changes.wait_for(partial(self._moved, seen)), remaining)
                    except TimeoutError:
                        return None
            return None
        finally:
            self._waiters -= 1
            if self._waiters == 0 and self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None
                self._latest = None

    async def release(self) -> None:
        """End every wait now, and any later one at once (the agent is stopping)."""
        self._released = True
        async with self._changes:
            self._ticks += 1
            self._changes.notify_all()

    def _moved(self, seen: int) -> bool:
        return self._released or self._ticks != seen

    def _geometry_changed(self, gpu: str) -> None:
        """The ledger's watcher (on the event loop): a GPU's instances changed."""
        self._stale.add(gpu)
        self._wake.set()

    async def _watch(self) -> None:
        """Observe the facts while anyone waits; wake the waiters when they change."""
        loop = asyncio.get_running_loop()
        refreshed = loop.time()
        first = True
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            self._wake.clear()
            due = loop.time() - refreshed >= self._refresh_s
            fresh = due or bool(self._stale)
            if fresh:
                changed, self._stale = self._stale, set()
                if due:
                    refreshed = loop.time()
                await self._refresh_inventory(() if due else changed)
            marks = tuple(self._ledger.health_marks(g.uuid) for g in self._inventory.gpus)
            if not fresh and marks != self._marks:
                # A GPU was lost, reset or its XID cleared: read the GPUs afresh, or a
                # snapshot taken while a GPU was lost keeps its lost taint until the next
                # refresh (its own health says lost, in the very words of the mark).
                refreshed = loop.time()
                await self._refresh_inventory()
            self._marks = marks
            facts = tuple(self.facts())
            if first or facts != self._latest:
                first = False
                self._latest = facts
                async with self._changes:
                    self._ticks += 1
                    self._changes.notify_all()

    async def _refresh_inventory(self, only: Collection[str] = ()) -> None:
        try:
            await self._inventory.refresh(only)
        except AgentError as err:  # the waiters still see the in-memory changes
            log.warning("inventory refresh for resourceslices failed",
                        extra={"error": err.detail})

    def _options(self, kubernetes: tuple[int, int], *, generation: int) -> RenderOptions:
        return RenderOptions(driver=self.driver, node_name=self.node_name,
                             kubernetes=kubernetes, dynamic_mig=self.dynamic_mig,
                             gpu_shares=self.gpu_shares, generation=generation,
                             no_execute=self._ledger.no_execute)
