"""The plugin's view of each device's health, from the agent's slices."""

from __future__ import annotations

import asyncio

from agent.kubeplugin.device_health import DeviceHealthView, states_of


def slices(*devices: dict[str, object]) -> list[dict[str, object]]:
    return [{"spec": {"devices": list(devices)}}]


def test_blocking_taints_make_a_device_unhealthy_informational_ones_do_not() -> None:
    states = states_of(slices(
        {"name": "gpu-0"},
        {"name": "gpu-1", "taints": [{"key": "d/xid", "value": "31", "effect": "None"}]},
        {"name": "gpu-2", "taints": [{"key": "d/xid", "value": "48", "effect": "NoSchedule"},
                                     {"key": "d/unmonitored", "effect": "None"}]}))
    assert {n: s.health for n, s in states.items()} == {
        "gpu-0": "Healthy", "gpu-1": "Healthy", "gpu-2": "Unhealthy"}
    assert states["gpu-2"].reason == "d/xid=48:NoSchedule, d/unmonitored:None"


async def test_unknown_while_the_agent_is_away_and_waiters_wake_on_change() -> None:
    view = DeviceHealthView()
    assert view.state("gpu-0").health == "Unknown"
    waiter = asyncio.create_task(view.wait_changed(view.version))
    await view.update(slices({"name": "gpu-0"}))
    assert await asyncio.wait_for(waiter, 5) == view.version
    assert view.state("gpu-0").health == "Healthy"
    assert view.state("gpu-9").health == "Unknown"
    before = view.version
    await view.update(slices({"name": "gpu-0"}))  # the same: no change
    assert view.version == before
    await view.update(None)
    assert view.state("gpu-0").health == "Unknown" and view.version == before + 1
