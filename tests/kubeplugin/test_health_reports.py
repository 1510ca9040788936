"""What the health stream reports (agent/kubeplugin/health_stream.py), in memory: which
devices count as prepared, each device's health and message from the view, and how the
streams share one read of the agent's claims, resend, and end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.kubeplugin.device_health import DeviceHealthView, DeviceState
from agent.kubeplugin.errors import AgentUnreachable
from agent.kubeplugin.health_stream import (
    MAX_MESSAGE,
    UNKNOWN_MESSAGE,
    DeviceKey,
    DeviceReport,
    HealthStreams,
    as_messages,
    message_of,
    prepared_devices,
    report,
)
from agent.kubeplugin.proto import dra_health_v1_pb2, dra_health_v1alpha1_pb2
from tests.waiting import until

XID = {"key": "gpu.nodeagent.dev/xid", "value": "48", "effect": "NoSchedule"}
APP_XID = {"key": "gpu.nodeagent.dev/xid", "value": "31", "effect": "None"}


def claim(state: str, *devices: str, pool: str = "node-a") -> dict[str, Any]:
    return {"uid": f"u-{state}-{'-'.join(devices)}", "state": state,
            "devices": [{"pool": pool, "device_name": d} for d in devices]}


def slices(**taints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"spec": {"devices": [{"name": name, "taints": t} for name, t in taints.items()]}}]


@pytest.mark.parametrize(("claims", "expected"), [
    ([], set()),
    ([claim("prepare_completed", "gpu-0", "gpu-1")], {"gpu-0", "gpu-1"}),
    # Lost since (a reboot, a GPU gone): kubelet still holds it and should hear about it.
    ([claim("lost", "gpu-2")], {"gpu-2"}),
    # Not prepared yet, or on its way out: kubelet does not hold it.
    ([claim("prepare_started", "gpu-3"), claim("unprepare_started", "gpu-4")], set()),
    # Two shares of one GPU: one device for kubelet.
    ([claim("prepare_completed", "gpu-5"), claim("prepare_completed", "gpu-5")], {"gpu-5"}),
    ([{"state": "prepare_completed", "devices": [{"pool": 1, "device_name": "x"}, {}]}],
     set()),
])
def test_prepared_devices(claims: list[dict[str, Any]], expected: set[str]) -> None:
    assert prepared_devices(claims) == {DeviceKey("node-a", d) for d in expected}


@pytest.mark.parametrize(("state", "expected"), [
    (DeviceState("Healthy"), ""),
    (DeviceState("Healthy", (APP_XID,)), "gpu.nodeagent.dev/xid=31:None"),
    (DeviceState("Unhealthy", (XID,)), "gpu.nodeagent.dev/xid=48:NoSchedule"),
    (DeviceState("Unknown"), UNKNOWN_MESSAGE),
])
def test_message_says_why(state: DeviceState, expected: str) -> None:
    assert message_of(state) == expected


def test_a_long_message_is_cut_to_what_kubelet_keeps() -> None:
    taints = tuple({"key": f"k{i}", "effect": "NoSchedule"} for i in range(300))
    text = message_of(DeviceState("Unhealthy", taints))
    assert len(text) == MAX_MESSAGE and text.endswith("...")


async def test_report_reads_each_device_from_the_view() -> None:
    view = DeviceHealthView()
    keys = [DeviceKey("node-a", n) for n in ("gpu-1", "gpu-0", "gpu-9")]
    assert {r.health for r in report(keys, view)} == {"Unknown"}  # no agent answer yet
    await view.update(slices(**{"gpu-0": [], "gpu-1": [XID]}))
    assert report(keys, view) == (
        DeviceReport(keys[1], "Healthy", ""),
        DeviceReport(keys[0], "Unhealthy", "gpu.nodeagent.dev/xid=48:NoSchedule"),
        DeviceReport(keys[2], "Unknown", UNKNOWN_MESSAGE))


@pytest.mark.parametrize("pb2", [dra_health_v1_pb2, dra_health_v1alpha1_pb2])
def test_as_messages(pb2: Any) -> None:
    answer = as_messages([DeviceReport(DeviceKey("node-a", "gpu-0"), "Unhealthy", "why")], pb2)
    [device] = answer.devices
    assert (device.device.pool_name, device.device.device_name, device.health,
            device.message, device.health_check_timeout_seconds) == (
        "node-a", "gpu-0", pb2.UNHEALTHY, "why", 30)
    assert device.last_updated_time > 0


class Claims:
    """The agent's claims as ``GET /v1/claims`` answers them; counts the reads."""

    def __init__(self) -> None:
        self.answer: list[dict[str, Any]] = []
        self.reads = 0
        self.down = False

    async def claims(self) -> list[dict[str, Any]]:
        self.reads += 1
        if self.down:
            raise AgentUnreachable("agent socket: gone")
        return self.answer


async def collect(streams: HealthStreams, into: list[tuple[DeviceReport, ...]]) -> None:
    async for reports in streams.reports():
        into.append(reports)


async def test_streams_follow_health_and_claims_and_end_at_close() -> None:
    """Two streams: one read of the claims serves both; a health change and a claims change
    each send a new report; a resend repeats it; close ends both."""
    view, claims = DeviceHealthView(), Claims()
    await view.update(slices(**{"gpu-0": []}))
    claims.answer = [claim("prepare_completed", "gpu-0")]
    streams = HealthStreams(view, claims, resend_s=3600)
    streams.start()
    got: tuple[list[tuple[DeviceReport, ...]], ...] = ([], [])
    tasks = [asyncio.create_task(collect(streams, g)) for g in got]
    healthy = (DeviceReport(DeviceKey("node-a", "gpu-0"), "Healthy", ""),)
    await until(lambda: all(g == [healthy] for g in got), "a first report on each")
    assert claims.reads == 1

    await view.update(slices(**{"gpu-0": [XID]}))
    await until(lambda: all(len(g) == 2 and g[1][0].health == "Unhealthy" for g in got),
                "the health change on each")
    assert claims.reads == 1, "a health change needs no new read of the claims"

    claims.answer = []
    streams.claims_changed()
    await until(lambda: all(len(g) == 3 and g[2] == () for g in got), "the unprepare on each")
    assert claims.reads == 2

    await streams.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert streams.open == 0


async def test_a_quiet_stream_resends_and_keeps_the_last_devices_while_the_agent_is_away(
        ) -> None:
    view, claims = DeviceHealthView(), Claims()
    claims.answer = [claim("prepare_completed", "gpu-3")]
    streams = HealthStreams(view, claims, resend_s=0.05)
    streams.start()
    got: list[tuple[DeviceReport, ...]] = []
    task = asyncio.create_task(collect(streams, got))
    await until(lambda: len(got) >= 3, "resent reports")
    claims.down = True
    reads = claims.reads
    await until(lambda: claims.reads > reads + 1, "more reads while the agent is away")
    assert {r.key.device for r in got[-1]} == {"gpu-3"}
    await streams.close()
    await asyncio.wait_for(task, 30)
