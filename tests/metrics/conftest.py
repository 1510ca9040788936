"""A simulated DGX H100 behind the real NVML session, inventory and metrics objects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.events import EventLog
from agent.gpu import mig
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Placement
from agent.metrics.agent import AgentMetrics
from agent.metrics.collector import Collector
from agent.metrics.health import GpuHealth

ONE_G_10GB = 19  # the H100 device profile id of 1g.10gb


@dataclass
class Sim:
    node: SimulatedNode
    session: NvmlSession
    inventory: GpuInventory
    metrics: AgentMetrics
    events: EventLog
    health: GpuHealth

    def collector(self, **kwargs: Any) -> Collector:
        options: dict[str, Any] = {"interval_s": 5.0, "hostname": "node-a"}
        options.update(kwargs)
        return Collector(session=self.session, inventory=self.inventory, metrics=self.metrics,
                         health=self.health, **options)

    def calls(self) -> dict[str, int]:
        """The simulator's NVML call counters, copied."""
        with self.node.hardware.lock:
            return dict(self.node.hardware.calls)

    async def split(self, index: int, starts: tuple[int, ...] = tuple(range(7))) -> None:
        """MIG on GPU ``index`` with a 1g.10gb (GI + CI) at each start, as the agent makes."""
        uuid = self.node.gpu_uuids()[index]

        def apply() -> None:
            handle = self.session.call("nvmlDeviceGetHandleByUUID", uuid)
            mig.set_mig_mode(self.session, handle, uuid, True)
            for start in starts:
                gi = mig.create_gpu_instance(self.session, handle, uuid, ONE_G_10GB,
                                             Placement(start, 1))
                mig.create_compute_instance(self.session, handle, uuid, gi)

        await self.session.read(apply)
        await self.inventory.refresh()


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[Sim]:
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    metrics = AgentMetrics(process=False)
    session = NvmlSession(node.nvml, on_error=metrics.count_nvml_error)
    inventory = GpuInventory(session)
    await session.initialise()
    await inventory.load()
    events = EventLog()
    health = GpuHealth(events=events, metrics=metrics, lost_reason=session.lost_reason)
    yield Sim(node, session, inventory, metrics, events, health)
    session.close()
    node.close()
