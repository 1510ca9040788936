"""Which allocated MIG devices the agent makes on demand: with ``--dynamic-mig`` the agent
publishes every MIG profile and placement as a partitionable device (one that consumes its
GPU's counters), and a claim of one is a slice to create (``{"kind": "slice", "device":
name}``), not an existing device to hand out. The plugin learns which names those are from
the agent's own ResourceSlices, the same list the scheduler allocated from.

Names are stable (minor, profile, placement), so each is looked up once: the slices are read
again only when a claim names a device this has not seen, and then with the last ETag, so an
unchanged list costs a 304.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from agent.device_names import parse_device_name
from agent.kubeplugin.agent_client import AgentClient

#: Any version the agent renders; the device entries' names and counters are the same in all.
SLICES_FOR = "1.35"


def _devices(items: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for item in items:
        yield from (item.get("spec") or {}).get("devices") or []


class DeviceKinds:
    """The agent's published device names, and which of them are MIG devices made on demand."""

    def __init__(self, agent: AgentClient) -> None:
        self._agent = agent
        self._etag: str | None = None
        self._known: set[str] = set()
        self._on_demand: set[str] = set()
        self._lock = asyncio.Lock()

    async def on_demand(self, names: Iterable[str]) -> set[str]:
        """Those of ``names`` to prepare as on-demand slices. A MIG name the agent no longer
        publishes (its GPU turned unhealthy since the allocation) is one when the agent
        publishes on-demand devices at all, so the answer for a claim never changes between
        kubelet's retries."""
        wanted = set(names)
        if wanted - self._known:
            await self._refresh(wanted)
        dynamic = bool(self._on_demand)
        return {n for n in wanted if n in self._on_demand or (
            n not in self._known and dynamic and is_mig_name(n))}

    async def _refresh(self, wanted: set[str]) -> None:
        async with self._lock:
            if wanted <= self._known:  # concurrent prepares: the first one's read did it
                return
            answer = await self._agent.resource_slices(SLICES_FOR, self._etag, 0)
            if answer.items is None:
                return
            known, on_demand = set(), set()
            for device in _devices(answer.items):
                name = str(device.get("name", ""))
                known.add(name)
                if device.get("consumesCounters") and is_mig_name(name):
                    on_demand.add(name)
            self._known, self._on_demand, self._etag = known, on_demand, answer.etag


def is_mig_name(name: str) -> bool:
    """Whether ``name`` is a MIG device's ResourceSlice name."""
    parsed = parse_device_name(name)
    return parsed is not None and parsed.profile is not None
