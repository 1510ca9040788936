"""The claims' operator signals, sampled on the event loop: claims by the state of their
ledger holds, how long the oldest reservation has lasted, what each shareable GPU has left,
the MPS daemons by state, and the memory each share's MPS clients use (for the DCGM series of
a shared GPU, ``agent.claims.attribution.share_attribution``).

The ledger records no time on a hold, so a reservation's age is counted from the first
sample that saw it: it is at most one interval short, which is nothing next to the minutes
the stuck-prepare alert waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.claims.service import ClaimService
from agent.device_names import shareable_mib
from agent.errors import AgentError
from agent.gpu.inventory import GpuInventory
from agent.gpu.types import Gpu
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import NodeLedger
from agent.metrics.claims import ClaimMetrics, ClaimSignals, GpuShareUse

log = logging.getLogger("agent.claims.signals")

#: (claim UID, GPU UUID) -> MiB its MPS clients use on that GPU.
ShareUsed = Mapping[tuple[str, str], int]


def shareable(gpu: Gpu) -> bool:
    """Whether the GPU can be shared by memory: a full GPU with MIG off (docs/sharing.md)."""
    return not gpu.mig_devices and not (gpu.mig_mode is not None and gpu.mig_mode.current)


@dataclass
class ClaimSampler:
    """Takes a :class:`ClaimSignals` sample every ``interval_s`` and publishes it."""

    claims: ClaimService
    ledger: NodeLedger
    inventory: GpuInventory
    metrics: ClaimMetrics
    #: --gpu-shares: every full GPU with MIG off is published shareable, shared or not.
    gpu_shares: bool = False
    clock: Callable[[], float] = time.monotonic
    #: The last sample's share usage, read by the collector thread (replaced whole).
    share_used: ShareUsed = field(default_factory=dict)
    _reserved_since: dict[str, float] = field(default_factory=dict)

    async def sample(self) -> ClaimSignals:
        """One sample, published; the share reads await, the rest does not, so the gauges
        change in one step of the loop."""
        uses: list[GpuShareUse] = []
        used: dict[tuple[str, str], int] = {}
        for gpu in self.inventory.gpus:
            if not shareable(gpu):
                continue
            shares = await self.claims.shares_of(gpu)
            capacity = shareable_mib(gpu.static.memory_total_mib)
            if shares is not None:
                uses.append(GpuShareUse(gpu.index, gpu.uuid, capacity, shares.taken_mib,
                                        len(shares.holders)))
                used.update({(h.claim, gpu.uuid): h.used_mib for h in shares.holders
                             if h.used_mib is not None})
            elif self.gpu_shares:
                holders = self.ledger.holders(DeviceKey(gpu.uuid))
                uses.append(GpuShareUse(gpu.index, gpu.uuid, capacity,
                                        capacity if holders else 0, len(holders)))
        now = self.clock()
        states: dict[str, str] = {}
        for hold in self.ledger.holds():
            # One state per claim: settle moves all of a claim's holds at once.
            states.setdefault(hold.holder, hold.state)
        reserved = {uid for uid, state in states.items() if state == "reserved"}
        self._reserved_since = {uid: self._reserved_since.get(uid, now) for uid in reserved}
        oldest = now - min(self._reserved_since.values()) if reserved else 0.0
        daemons: Counter[str] = Counter(d.state for r in self.claims.records()
                                        for d in r.daemons())
        sample = ClaimSignals(claims=Counter(states.values()), oldest_reserved_s=oldest,
                              shares=tuple(uses), mps_daemons=daemons)
        self.share_used = used
        self.metrics.publish(sample)
        return sample

    async def run(self, interval_s: float) -> None:
        """Sample every ``interval_s`` (a task of the node)."""
        while True:
            try:
                await self.sample()
            except (AgentError, OSError) as err:
                log.warning("claim signals not sampled", extra={"error": str(err)})
            await asyncio.sleep(interval_s)
