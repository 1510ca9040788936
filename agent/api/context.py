"""What the handlers share, as typed application keys (no untyped state bags)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agent.api.auth import TokenStore
from agent.claims.service import ClaimService
from agent.dra.service import SliceService
from agent.events import EventLog
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.metrics.agent import AgentMetrics
from agent.metrics.collector import Collector
from agent.metrics.health import GpuHealth
from agent.mig.service import MigService
from agent.settings import Settings
from agent.topology.service import TopologyService


@dataclass
class Readiness:
    """Why the agent is not ready yet; ``reason`` is ``None`` once it is."""

    reason: str | None = "starting"
    since: float = field(default_factory=time.monotonic)
    #: Called with the new reason on every change (e.g. systemd's STATUS= lines).
    watchers: list[Callable[[str | None], None]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.reason is None

    def set(self, reason: str | None) -> None:
        if reason != self.reason:
            self.reason = reason
            self.since = time.monotonic()
            for watcher in self.watchers:
                watcher(reason)


@dataclass
class AgentContext:
    settings: Settings
    session: NvmlSession
    inventory: GpuInventory
    events: EventLog
    tokens: TokenStore
    metrics: AgentMetrics
    backend: str
    readiness: Readiness = field(default_factory=Readiness)
    mig: MigService | None = None
    claims: ClaimService | None = None
    #: The DCGM metrics collector and the GPU health marks (XIDs, lost GPUs).
    collector: Collector | None = None
    health: GpuHealth | None = None
    #: NVLink/PCIe topology and best-set selection; the node's ResourceSlices.
    topology: TopologyService | None = None
    slices: SliceService | None = None
    #: The simulated node's controls (``agent.gpu.sim.node.SimulatedNode``) with --simulate.
    sim: Any = None


AGENT = web.AppKey("agent", AgentContext)
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
REQUEST_ID = web.RequestKey("request_id", str)
PRINCIPAL = web.RequestKey("principal", str)
