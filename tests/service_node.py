"""The agent's node in-process over a simulated DGX H100, built by the agent's own wiring
(``agent.wiring.build_node``) but served without HTTP: the claim tests, the disk-trouble and
soak tests and the claims benchmark use it."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.claims.service import ClaimService
from agent.events import EventLog
from agent.gpu import backend as gpu_backend
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Gpu
from agent.ledger.ledger import NodeLedger
from agent.mig.geometry import DesiredProfiles
from agent.mig.service import MigService, Outcome
from agent.mig.transition import DrainPolicy, TransitionState
from agent.settings import resolve
from agent.wiring import Node, build_node


@dataclass
class ServiceNode:
    """A started :class:`Node` with shortcuts for tests."""

    node: Node
    state: Path
    cdi_dir: Path
    #: Leaves the node's ``running()`` block: stops it as the daemon would.
    _running: AsyncExitStack

    @property
    def sim(self) -> SimulatedNode:
        assert self.node.sim is not None
        return self.node.sim

    @property
    def session(self) -> NvmlSession:
        return self.node.session

    @property
    def inventory(self) -> GpuInventory:
        return self.node.inventory

    @property
    def mig(self) -> MigService:
        return self.node.mig

    @property
    def claims(self) -> ClaimService:
        return self.node.claims

    @property
    def ledger(self) -> NodeLedger:
        return self.node.ledger

    @property
    def events(self) -> EventLog:
        return self.node.events

    async def gpu(self, index: int) -> Gpu:
        await self.inventory.refresh()
        return self.inventory.find(str(index))

    async def mig_to(self, index: int, profiles: list[str]) -> None:
        """Set one GPU's geometry and wait for the transition to succeed."""
        await self._finish([await self.mig.request(
            await self.gpu(index), DesiredProfiles.of(profiles), DrainPolicy())])

    async def mig_all(self, profiles: list[str]) -> None:
        """The same geometry on every GPU, all at once."""
        await self.inventory.refresh()
        await self._finish([await self.mig.request(gpu, DesiredProfiles.of(profiles),
                                                   DrainPolicy())
                            for gpu in self.inventory.gpus])

    @staticmethod
    async def _finish(outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.transition is not None:
                await outcome.transition.finished.wait()
                if outcome.transition.state != TransitionState.SUCCEEDED:
                    raise RuntimeError(f"MIG change ended {outcome.transition.state}")

    async def stop(self) -> None:
        """Stop the node (the simulated hardware stays open)."""
        await self._running.aclose()

    async def close(self) -> None:
        await self.stop()
        self.sim.close()


async def open_services(directory: Path, *, spec_dir: Path | None = None,
                        tombstone_s: float = 600.0, preset: str = "dgx-h100",
                        settings: Mapping[str, Any] | None = None) -> ServiceNode:
    """A simulated node (DGX H100 unless ``preset`` says otherwise) under ``directory``
    (state, proc, cdi), started (recovered and reconciled) through the agent's wiring;
    ``settings`` adds to (or overrides) the agent's settings."""
    state, proc = directory / "state", directory / "proc"
    cdi_dir = spec_dir or directory / "cdi"
    resolved = resolve({"simulate": preset, "state_dir": state, "proc_root": proc,
                        "cdi_dir": cdi_dir, "claim_tombstone_s": tombstone_s,
                        "run_dir": directory / "run", "collect_interval": 3600.0,
                        **(settings or {})}, env={})
    backend = gpu_backend.open_backend(simulate=resolved.simulate, state_dir=state,
                                       proc_root=proc)
    return await start(build_node(resolved, backend), state, cdi_dir)


async def start(node: Node, state: Path, cdi_dir: Path) -> ServiceNode:
    """``node`` started through its one lifecycle (``Node.running``), until closed."""
    running = AsyncExitStack()
    await running.enter_async_context(node.running())
    return ServiceNode(node, state, cdi_dir, running)
