"""The node's topology as a service: discovered once NVML is up (in the read pool), kept,
and asked which GPUs are free to choose right now (health, quarantine, MIG, claims)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from agent.errors import NotReady
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.topology import NodeLinks, read_node_links
from agent.gpu.types import Gpu
from agent.topology.graph import TopologyGraph, build_graph

log = logging.getLogger("agent.topology")


class HeldDevices(Protocol):
    """Who holds a GPU or any device carved from it (the claims service implements this)."""

    def holders(self, gpu_uuid: str) -> Sequence[str]:
        """Claim UIDs holding the GPU itself or any of its MIG devices."""
        ...


class NoHeldDevices:
    """Before claims exist: nothing is held."""

    def holders(self, gpu_uuid: str) -> Sequence[str]:
        return ()


class Quarantine(Protocol):
    def quarantined(self, gpu: str) -> str | None: ...


class TopologyService:
    def __init__(self, *, session: NvmlSession, inventory: GpuInventory,
                 sys_root: Path = Path("/sys"), held: HeldDevices | None = None,
                 quarantine: Quarantine | None = None) -> None:
        self._session = session
        self._inventory = inventory
        self._sys_root = sys_root
        self.held: HeldDevices = held or NoHeldDevices()
        self.quarantine = quarantine
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
        """GPU index -> why it may not be chosen whole: unhealthy, quarantined, split by MIG,
        or (partly) held by claims."""
        found: dict[int, str] = {}
        for gpu in gpus:
            quarantined = self.quarantine.quarantined(gpu.uuid) if self.quarantine else None
            holders = list(self.held.holders(gpu.uuid))
            if not gpu.health.healthy:
                found[gpu.index] = "unhealthy: " + "; ".join(gpu.health.reasons)
            elif quarantined:
                found[gpu.index] = f"quarantined: {quarantined}"
            elif gpu.mig_mode is not None and (gpu.mig_mode.current or gpu.mig_devices):
                found[gpu.index] = "split by MIG"
            elif holders:
                found[gpu.index] = "held by claim " + ", ".join(holders)
        return found


class _Device(Protocol):
    @property
    def gpu(self) -> str: ...


class _Claim(Protocol):
    @property
    def uid(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def devices(self) -> Sequence[_Device]: ...


class _Claims(Protocol):
    def claims(self) -> Sequence[_Claim]: ...


class HeldByClaims:
    """:class:`HeldDevices` read from the claims service: any prepared (or preparing) claim
    with a device on the GPU, whole or a MIG device, holds it."""

    def __init__(self, claims: _Claims) -> None:
        self._claims = claims

    def holders(self, gpu_uuid: str) -> Sequence[str]:
        return [c.uid for c in self._claims.claims()
                if c.state != "lost" and any(d.gpu == gpu_uuid for d in c.devices)]
