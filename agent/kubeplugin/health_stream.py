"""Kubelet's DRA health stream (``NodeWatchResources``): the health of every device of the
claims the agent holds prepared, from the one availability model (:class:`DeviceHealthView`).

Every stream gets the full report at once, again whenever a device's health or the set of
prepared devices changes, and at least every :data:`RESEND_S`: kubelet reads a device as
``Unknown`` once its last report is :data:`TIMEOUT_S` old (1.34 always after 30 s), so a
quiet plugin must still say that nothing changed. Which devices are prepared is the agent's
answer to ``GET /v1/claims`` (it keeps the claims across plugin restarts, which kubelet does
not repeat prepares for); the servers mark it stale after each prepare and unprepare, and
one read serves every stream. An agent that does not answer leaves the last set reported,
with the health the view gives it (``Unknown`` once the publisher counts the agent lost).

Kubelet drops the driver's health when a stream ends, so :meth:`HealthStreams.close` (the
plugin's stop) ends every stream cleanly instead of leaving them to be cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.kubeplugin.device_health import DeviceHealthView, DeviceState, Health
from agent.kubeplugin.errors import AgentCallError

log = logging.getLogger("agent.kubeplugin.health_stream")

#: A report is repeated this often with nothing changed, well inside kubelet's timeout.
RESEND_S = 10.0
#: How long kubelet may trust a report (sent as ``health_check_timeout_seconds``; 1.34 has
#: the field not and uses 30 s): three missed resends.
TIMEOUT_S = 30
#: Kubelet keeps this many characters of a message.
MAX_MESSAGE = 1024
#: Claim states whose devices kubelet holds prepared: done, or lost since (the devices are
#: gone, kubelet's pod still runs and should see it).
PREPARED_STATES = frozenset({"prepare_completed", "lost"})
UNKNOWN_MESSAGE = "the GPU agent does not report this device (not answering, or the GPU is gone)"

Json = dict[str, Any]


class ClaimLister(Protocol):
    """The agent's prepared claims (``AgentClient.claims``)."""

    async def claims(self) -> list[Json]:
        """``GET /v1/claims``: the claims, as the agent answers them."""
        ...


@dataclass(frozen=True, order=True)
class DeviceKey:
    """A device as kubelet names it: its ResourceSlice pool and device name."""

    pool: str
    device: str


@dataclass(frozen=True)
class DeviceReport:
    """One device's entry of a report."""

    key: DeviceKey
    health: Health
    message: str


def prepared_devices(claims: Iterable[Mapping[str, Any]]) -> frozenset[DeviceKey]:
    """The devices of the claims in :data:`PREPARED_STATES` (a device shared by several
    claims once: kubelet keys its health by pool and device)."""
    found = set()
    for claim in claims:
        if claim.get("state") not in PREPARED_STATES:
            continue
        for device in claim.get("devices") or ():
            pool, name = device.get("pool"), device.get("device_name")
            if isinstance(pool, str) and isinstance(name, str):
                found.add(DeviceKey(pool, name))
    return frozenset(found)


def message_of(state: DeviceState) -> str:
    """Why a device is what it is, for the pod's status: its taints, or why it is unknown."""
    text = UNKNOWN_MESSAGE if state.health == "Unknown" else state.reason
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def report(devices: Iterable[DeviceKey], view: DeviceHealthView) -> tuple[DeviceReport, ...]:
    """The full report for ``devices``, in a stable order."""
    out = []
    for key in sorted(devices):
        state = view.state(key.device)
        out.append(DeviceReport(key, state.health, message_of(state)))
    return tuple(out)


class HealthStreams:
    """What every ``NodeWatchResources`` stream sends (:meth:`reports`), for both versions
    of the service; one per plugin, in its event loop."""

    def __init__(self, view: DeviceHealthView, agent: ClaimLister, *,
                 resend_s: float = RESEND_S) -> None:
        self._view = view
        self._agent = agent
        self._resend_s = resend_s
        self._wake = asyncio.Event()
        self._closed = False
        self._following: asyncio.Task[None] | None = None
        # The prepared devices, and which claims version the last read of them answered.
        self._devices: frozenset[DeviceKey] = frozenset()
        self._claims_version = 0
        self._read_version = -1
        self._read_at = 0.0
        self._reading = asyncio.Lock()
        self._read_failing = False
        self.open = 0

    def start(self) -> None:
        """Follow the view's changes (idempotent)."""
        if self._following is None:
            self._following = asyncio.create_task(self._follow_view())

    async def close(self) -> None:
        """End every stream (each returns after its current send) and stop following."""
        self._closed = True
        self._changed()
        if self._following is not None:
            self._following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._following
            self._following = None

    def claims_changed(self) -> None:
        """Kubelet prepared or unprepared claims: the next report reads them again."""
        self._claims_version += 1
        self._changed()

    async def reports(self) -> AsyncIterator[tuple[DeviceReport, ...]]:
        """One stream: the full report now, then on every change and every ``resend_s``,
        until :meth:`close`."""
        self.open += 1
        log.info("kubelet opened a health stream", extra={"streams": self.open})
        try:
            while not self._closed:
                wake = self._wake
                devices = await self._prepared()
                yield report(devices, self._view)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self._resend_s)
        finally:
            self.open -= 1
            log.info("health stream ended", extra={"streams": self.open,
                                                   "plugin_stopping": self._closed})

    def _changed(self) -> None:
        """Wake every stream: the event they wait on is set and a fresh one takes its place."""
        self._wake.set()
        self._wake = asyncio.Event()

    async def _follow_view(self) -> None:
        version = self._view.version
        while True:
            version = await self._view.wait_changed(version)
            self._changed()

    async def _prepared(self) -> frozenset[DeviceKey]:
        """The prepared devices: read again when claims changed since the last read or it
        is older than ``resend_s``; one read at a time serves every stream waiting."""
        async with self._reading:
            version = self._claims_version
            fresh = time.monotonic() - self._read_at < self._resend_s
            if version == self._read_version and fresh:
                return self._devices
            try:
                claims = await self._agent.claims()
            except AgentCallError as err:
                if not self._read_failing:
                    log.warning("cannot read the prepared claims from the agent; reporting "
                                "the last known devices", extra={"error": str(err)})
                self._read_failing = True
                return self._devices
            if self._read_failing:
                log.info("prepared claims read from the agent again")
            self._read_failing = False
            self._devices = prepared_devices(claims)
            self._read_version, self._read_at = version, time.monotonic()
            return self._devices


def last_updated(now: float | None = None) -> int:
    """The report's ``last_updated_time``: Unix seconds."""
    return int(time.time() if now is None else now)


def as_messages(reports: Sequence[DeviceReport], pb2: Any) -> Any:
    """``reports`` as a ``NodeWatchResourcesResponse`` of ``pb2`` (``dra_health_v1_pb2`` or
    ``dra_health_v1alpha1_pb2``: the same messages)."""
    now = last_updated()
    answer = pb2.NodeWatchResourcesResponse()
    for entry in reports:
        answer.devices.add(
            device=pb2.DeviceIdentifier(pool_name=entry.key.pool, device_name=entry.key.device),
            health=pb2.HealthStatus.Value(entry.health.upper()), last_updated_time=now,
            health_check_timeout_seconds=TIMEOUT_S, message=entry.message)
    return answer
