"""The node's topology as a service: discovered once NVML is up (in the read pool), kept,
and asked which GPUs are free to choose right now (the ledger's availability, MIG)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from agent.errors import NotReady
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.topology import NodeLinks, read_node_links
from agent.gpu.types import Gpu
from agent.ledger.ledger import NodeLedger
from agent.topology.graph import TopologyGraph, build_graph

log = logging.getLogger("agent.topology")


class TopologyService:
    def __init__(self, *, session: NvmlSession, inventory: GpuInventory, ledger: NodeLedger,
                 sys_root: Path = Path("/sys")) -> None:
        self._session = session
        self._inventory = inventory
        self._sys_root = sys_root
        self._ledger = ledger
        self._links: NodeLinks | None = None
        self._graph: TopologyGraph | None = None

    @property
    def loaded(self) -> bool:
        return self._graph is not None

    async def load(self) -> TopologyGraph:
        """Discover the wiring (after the inventory is loaded); once per agent start."""
        statics = tuple(g.static for g in self._inventory.gpus)
        links = await self._session.read(partial(read_node_links, self._session, statics,
                                                 sys_root=self._sys_root))
        self._links = links
        self._graph = build_graph(links)
        log.info("topology discovered", extra={
            "gpus": len(statics), "islands": len(self._graph.islands()),
            "problems": len(self._graph.notes)})
        return self._graph

    @property
    def links(self) -> NodeLinks:
        if self._links is None:
            raise NotReady("topology not discovered yet")
        return self._links

    @property
    def graph(self) -> TopologyGraph:
        if self._graph is None:
            raise NotReady("topology not discovered yet")
        return self._graph

    def unavailable(self, gpus: Sequence[Gpu]) -> dict[int, str]:
        """GPU index -> why it may not be chosen whole: the ledger's availability (lost,
        unhealthy, quarantined, held by claims), or split by MIG."""
        found: dict[int, str] = {}
        for gpu in gpus:
            available = self._ledger.availability(gpu)
            if available.reasons:
                found[gpu.index] = "; ".join(available.reasons)
            elif gpu.mig_mode is not None and (gpu.mig_mode.current or gpu.mig_devices):
                found[gpu.index] = "split by MIG"
            elif available.holders:
                found[gpu.index] = "held by claim " + ", ".join(available.holders)
        return found
