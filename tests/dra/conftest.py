"""A simulated node with the inventory, topology and slice services, in process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.dra.service import ResourceSliceService
from agent.events import EventLog
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.presets import CI_PROFILE_BY_SLICES
from agent.gpu.types import Placement
from agent.ledger.ledger import NodeLedger
from agent.topology.service import TopologyService
from tests.gpu.sim.conftest import create_gi, enable_mig


@dataclass
class Env:
    node: SimulatedNode
    session: NvmlSession
    inventory: GpuInventory
    topology: TopologyService
    resource_slices: ResourceSliceService
    ledger: NodeLedger
    state_dir: Path

    def drain(self, index: int, placement: Placement) -> None:
        """Mark an instance as a MIG transition would while draining it."""
        self.ledger.gpu(self.node.gpu_uuids()[index]).draining[placement] = "t-test"

    def quarantine(self, index: int, reason: str) -> None:
        self.ledger.gpu(self.node.gpu_uuids()[index]).quarantine = reason

    def make_mig(self, index: int, instances: list[tuple[int, int]]) -> None:
        """MIG on for GPU ``index`` with GPU instances (profile id, start), each with one
        compute instance spanning it."""
        handle = enable_mig(self.node, index)
        model = self.node.preset.gpu
        for profile_id, start in instances:
            gi = create_gi(self.node, handle, profile_id, (start, model.gi_profile(
                profile_id).size))  # type: ignore[union-attr]
            slices = model.gi_profile(profile_id).slices  # type: ignore[union-attr]
            self.node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_PROFILE_BY_SLICES[slices])


MakeEnv = Callable[..., Coroutine[Any, Any, Env]]


@pytest.fixture
async def make_env(tmp_path: Path) -> AsyncIterator[MakeEnv]:
    opened: list[Env] = []

    async def make(preset: str, *, dynamic_mig: bool = False,
                   setup: Callable[[Env], None] | None = None, name: str = "env") -> Env:
        state = tmp_path / name
        node = SimulatedNode(preset, state, tmp_path / f"{name}-proc")
        node.nvml.nvmlInit()
        session = NvmlSession(node.nvml)
        await session.initialise()
        inventory = GpuInventory(session)
        ledger = NodeLedger(quarantine_path=state / "mig" / "quarantine.json",
                            events=EventLog(), lost_reason=session.lost_reason)
        topology = TopologyService(session=session, inventory=inventory,
                                   sys_root=node.sys_root, ledger=ledger)
        env = Env(node, session, inventory, topology, ResourceSliceService(
            inventory=inventory, topology=topology, ledger=ledger, state_dir=state,
            node_name="gpu-node-1", dynamic_mig=dynamic_mig), ledger, state)
        opened.append(env)
        if setup is not None:
            setup(env)
        await inventory.load()
        await topology.load()
        return env

    yield make
    for env in opened:
        env.session.close()
        env.node.close()
