"""ResourceSlices of this node, rendered on request from the inventory, the ledger's
availability and marks, and the topology, with the pool generation kept in
``<state>/dra/pool.json``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agent.dra import rules
from agent.dra.generation import PoolGeneration, fingerprint
from agent.dra.slices import DEFAULT_DRIVER, GpuFacts, RenderOptions, render
from agent.errors import SlicesInvalid
from agent.gpu.inventory import GpuInventory
from agent.ledger.ledger import NodeLedger
from agent.topology.service import TopologyService

log = logging.getLogger("agent.dra")


class SliceService:
    def __init__(self, *, inventory: GpuInventory, topology: TopologyService,
                 ledger: NodeLedger, state_dir: Path, node_name: str,
                 driver: str = DEFAULT_DRIVER, dynamic_mig: bool = False) -> None:
        self._inventory = inventory
        self._topology = topology
        self._ledger = ledger
        self.node_name = node_name
        self.driver = driver
        self.dynamic_mig = dynamic_mig
        self.generation = PoolGeneration(state_dir / "dra" / "pool.json")

    def facts(self) -> list[GpuFacts]:
        """Every GPU of the last inventory snapshot, with the agent's marks and topology."""
        graph = self._topology.graph
        islands = graph.islands()
        found = []
        for gpu in self._inventory.gpus:
            node = graph.gpus[gpu.index] if gpu.index < graph.size else None
            island = next((members for members in islands if gpu.index in members), None)
            condition = self._ledger.condition(gpu)
            found.append(GpuFacts(
                gpu=gpu,
                draining=self._ledger.draining(gpu.uuid),
                unavailable="; ".join(condition) if condition else None,
                nvlink_island=graph.gpus[island[0]].uuid if island else None,
                nvlink_gb_s=round(node.nvlink_gb_s) if node else 0,
                clique=node.clique if node else None,
                pcie_root=node.pcie_root if node else None))
        return found

    async def slices(self, kubernetes: tuple[int, int]) -> list[dict[str, Any]]:
        """The pool for a Kubernetes version, from a fresh inventory read."""
        await self._inventory.refresh()
        facts = self.facts()
        driver = self._inventory.driver
        content = render(facts, driver, self._options((1, 35), generation=0))
        generation = await self.generation.for_content(fingerprint(content))
        slices = render(facts, driver, self._options(kubernetes, generation=generation))
        problems = rules.check(slices, kubernetes)
        if problems:
            # A slice the API server would refuse must never leave the agent.
            log.error("resourceslices invalid", extra={"problems": "; ".join(problems[:5])})
            raise SlicesInvalid("rendered ResourceSlices break Kubernetes validation rules: "
                                + "; ".join(problems[:5]), problems=problems)
        return slices

    def _options(self, kubernetes: tuple[int, int], *, generation: int) -> RenderOptions:
        return RenderOptions(driver=self.driver, node_name=self.node_name,
                             kubernetes=kubernetes, dynamic_mig=self.dynamic_mig,
                             generation=generation)
