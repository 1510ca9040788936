"""The agent's MIG and claim services in-process over a simulated node, wired as
``agent.daemon`` wires them but without HTTP: the claims benchmark and the claim tests use
the same one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.claims.cdi_writer import CdiWriter
from agent.claims.checkpoint import ClaimCheckpoint
from agent.claims.service import ClaimService
from agent.events import EventLog
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Gpu
from agent.host import boot_id
from agent.metrics.agent import AgentMetrics
from agent.mig.geometry import DesiredProfiles
from agent.mig.service import MigService, Outcome
from agent.mig.transition import DrainPolicy, TransitionState


@dataclass
class ServiceNode:
    sim: SimulatedNode
    session: NvmlSession
    inventory: GpuInventory
    mig: MigService
    claims: ClaimService
    state: Path
    cdi_dir: Path
    events: EventLog

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

    async def close(self) -> None:
        await self.mig.close()
        self.session.close()
        self.sim.close()


async def open_services(directory: Path, *, spec_dir: Path | None = None,
                        tombstone_s: float = 600.0) -> ServiceNode:
    """A simulated DGX H100 under ``directory`` (state, proc, cdi), claims reconciled."""
    state, proc = directory / "state", directory / "proc"
    cdi_dir = spec_dir or directory / "cdi"
    sim = SimulatedNode("dgx-h100", state, proc)
    session = NvmlSession(sim.nvml)
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    events = EventLog()
    mig = MigService(session=session, inventory=inventory, events=events,
                     metrics=AgentMetrics(), state_dir=state, proc_root=proc)
    claims = ClaimService(session=session, inventory=inventory, mig_service=mig, events=events,
                          checkpoint=ClaimCheckpoint(state / "claims.checkpoint", boot_id(proc)),
                          cdi=CdiWriter(cdi_dir, proc), tombstone_s=tombstone_s)
    await claims.reconcile()
    return ServiceNode(sim, session, inventory, mig, claims, state, cdi_dir, events)
