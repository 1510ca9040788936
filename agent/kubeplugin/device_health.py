"""Each device's health as the agent last published it: the one view the claim status writer
and kubelet's health stream read, fed by the publisher from every answer of the agent.

The agent renders every device of this node with its taints (``agent/health/taints.py``);
the publisher hands each answer here before it adapts the pool to what the API server keeps
(a server without taints has the blocking-tainted devices withdrawn, but their health is
still known here). While the agent does not answer, health is unknown, not healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Json = dict[str, Any]
Health = Literal["Healthy", "Unhealthy", "Unknown"]


@dataclass(frozen=True)
class DeviceState:
    """One device: its health and the taints behind it (as the slice carries them)."""

    health: Health
    taints: tuple[Json, ...] = ()

    @property
    def reason(self) -> str:
        """The taints as one line (``key=value:effect``, comma separated); empty if none."""
        return ", ".join(f"{t.get('key')}{'=' + str(t['value']) if t.get('value') else ''}"
                         f":{t.get('effect')}" for t in self.taints)


UNKNOWN = DeviceState("Unknown")


def states_of(slices: Sequence[Mapping[str, Any]]) -> dict[str, DeviceState]:
    """Device name -> state, from the agent's slices: a device with a taint whose effect is
    not ``None`` is unhealthy; informational taints leave it healthy."""
    found: dict[str, DeviceState] = {}
    for body in slices:
        for device in (body.get("spec") or {}).get("devices") or ():
            name = device.get("name")
            if not isinstance(name, str):
                continue
            taints = tuple(t for t in device.get("taints") or () if isinstance(t, dict))
            unhealthy = any(t.get("effect") != "None" for t in taints)
            found[name] = DeviceState("Unhealthy" if unhealthy else "Healthy", taints)
    return found


class DeviceHealthView:
    """The latest states, and a way to wait for them to change (one event loop)."""

    def __init__(self) -> None:
        self._states: dict[str, DeviceState] | None = None
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        """Counts changes; pass it to :meth:`wait_changed`."""
        return self._version

    def state(self, device: str) -> DeviceState:
        """A device's state; ``Unknown`` while the agent is away or for a device it does not
        publish (a GPU that disappeared)."""
        if self._states is None:
            return UNKNOWN
        return self._states.get(device, UNKNOWN)

    async def update(self, slices: Sequence[Mapping[str, Any]] | None) -> None:
        """The agent's latest slices (None: the agent is lost). Wakes waiters on a change."""
        states = None if slices is None else states_of(slices)
        if states == self._states:
            return
        self._states = states
        self._version += 1
        async with self._changed:
            self._changed.notify_all()

    async def wait_changed(self, version: int) -> int:
        """Wait until the version differs from ``version``; the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != version)
        return self._version
