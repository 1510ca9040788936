"""Clearing a GPU's XID faults: what an operator's word (or a reset the agent sees) lifts."""

from __future__ import annotations

import pytest

from agent.gpu.xid import XidEvent
from tests.metrics.conftest import Sim


@pytest.mark.parametrize(("xids", "cleared"), [
    ([48], ["XID 48: Double Bit ECC Error"]),
    ([48, 74, 48], ["XID 48: Double Bit ECC Error", "XID 74: NVLINK Error"]),
    ([13], ["XID 13: Graphics Engine Exception"]),  # an informational fault goes too
    ([], []),
])
async def test_clear_lifts_every_mark_and_reports_it_once(sim: Sim, xids: list[int],
                                                         cleared: list[str]) -> None:
    """``clear`` returns the faults it lifted, leaves the GPU without faults and its gauge
    at 1, and writes one ``gpu.health_cleared`` event only when there was something to
    clear."""
    health = sim.health
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[1]
    for xid in xids:
        health.record_xid(XidEvent(uuid, xid))
    assert health.clear(uuid, why="test") == cleared
    assert health.healthy(uuid) and health.faults(uuid) == ()
    assert sim.metrics.registry.get_sample_value(
        "gpu_agent_gpu_healthy", {"gpu": "1", "UUID": uuid}) == 1
    kinds = [e.kind for e in sim.events.since(0)]
    assert kinds.count("gpu.health_cleared") == (1 if cleared else 0)


async def test_a_mark_after_clearing_is_reported_again(sim: Sim) -> None:
    """The next critical XID after a clear marks the GPU again, with a new event each."""
    health = sim.health
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[2]
    health.record_xid(XidEvent(uuid, 79))
    health.clear(uuid, why="reset by hand")
    health.record_xid(XidEvent(uuid, 79))
    assert not health.healthy(uuid)
    kinds = [e.kind for e in sim.events.since(0)]
    assert kinds == ["gpu.xid", "gpu.unhealthy", "gpu.health_cleared", "gpu.xid",
                     "gpu.unhealthy"]
