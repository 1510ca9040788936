"""XIDs through NVML's event set, and the faults they leave: every XID is a fault (an
application XID an informational one), the events they log (coalesced), the counters, and a
watcher that stops promptly."""

from __future__ import annotations

import time

import pytest

from agent.gpu.sim.hardware import XID_FALLEN_OFF_THE_BUS
from agent.gpu.xid import XidEvent, XidWatcher
from agent.metrics.health import COALESCE_S, GpuHealth, xid_message
from tests.metrics.conftest import Sim
from tests.waiting import until


def sample(sim: Sim, name: str, **labels: str) -> float | None:
    """One sample of the agent's registry, as a scrape reads it."""
    return sim.metrics.registry.get_sample_value(name, labels)


async def test_watcher_reports_xids_of_gpus_and_mig_devices(sim: Sim) -> None:
    """An XID names its GPU by UUID (mapped from the event's handle) and, from a MIG device,
    its GPU and compute instance."""
    await sim.split(1, (0,))
    received: list[XidEvent] = []
    watcher = XidWatcher(sim.session, received.append, wait_ms=50)
    watcher.start(g.static for g in sim.inventory.gpus)
    try:
        await until(lambda: len(watcher.registered) == 8, "every GPU registered")
        uuids = sim.node.gpu_uuids()
        mig = sim.inventory.gpus[1].mig_devices[0]
        sim.node.inject_xid(uuids[3], 48)
        sim.node.inject_xid(mig.uuid, 31)
        sim.node.inject_xid(uuids[0], XID_FALLEN_OFF_THE_BUS)
        await until(lambda: len(received) >= 3, "the three XIDs")
        # With each, the GPU's recovery action (none after an application XID; unknown on
        # a GPU fallen off the bus, which answers no NVML call).
        assert received == [XidEvent(uuids[3], 48, recovery_action=1),
                            XidEvent(uuids[1], 31, mig.gi_id, mig.ci_id, recovery_action=0),
                            XidEvent(uuids[0], 79)]
    finally:
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 1.0  # one 50 ms wait slice, not a hang
    # Idle waits time out all the time; that is no NVML error.
    assert not [s for family in sim.metrics.registry.collect() for s in family.samples
                if s.name == "gpu_agent_nvml_errors_total"
                and s.labels["function"] == "nvmlEventSetWait_v2"]


def test_xid_messages() -> None:
    assert xid_message(79) == "GPU has fallen off the bus"
    assert xid_message(0) == "No Error"
    assert xid_message(99999) == "Unknown Error"


@pytest.mark.parametrize(("xid", "critical"), [(79, True), (48, True), (119, True),
                                               (13, False), (31, False)])
async def test_every_xid_is_a_fault_application_xids_informational(sim: Sim, xid: int,
                                                                  critical: bool) -> None:
    """Each XID becomes a fault whose value is the XID; only the others than application
    XIDs make the GPU unhealthy."""
    health = sim.health
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[2]
    health.record_xid(XidEvent(uuid, xid))
    assert [(f.kind, f.value) for f in health.faults(uuid)] == [("xid", str(xid))]
    assert health.healthy(uuid) is not critical
    assert bool(health.xid_reasons(uuid)) is critical
    assert health.last_xid(uuid) is not None and health.last_xid(uuid).xid == xid  # type: ignore[union-attr]
    assert sample(sim, "gpu_agent_gpu_healthy", gpu="2", UUID=uuid) == (0 if critical else 1)
    assert sample(sim, "gpu_agent_xid_errors_total", xid=str(xid)) == 1
    kinds = [e.kind for e in sim.events.since(0)]
    assert kinds == (["gpu.xid", "gpu.unhealthy"] if critical else ["gpu.xid"])


async def test_an_xid_storm_is_counted_but_logged_once_per_window(sim: Sim) -> None:
    now = [0.0]
    health = GpuHealth(events=sim.events, metrics=sim.metrics,
                       lost_reason=sim.session.lost_reason, clock=lambda: now[0])
    uuid = sim.node.gpu_uuids()[0]
    for _ in range(500):
        health.record_xid(XidEvent(uuid, 13))
    now[0] += COALESCE_S
    health.record_xid(XidEvent(uuid, 13))
    assert sample(sim, "gpu_agent_xid_errors_total", xid="13") == 501
    assert [e.kind for e in sim.events.since(0)] == ["gpu.xid", "gpu.xid"]


async def test_a_lost_gpu_is_unhealthy_with_an_event(sim: Sim) -> None:
    """GPU_IS_LOST seen by any NVML call marks the GPU (no XID needed)."""
    health = sim.health
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[4]
    sim.session.mark_lost(uuid, "nvmlDeviceGetPowerUsage returned NVML_ERROR_GPU_IS_LOST")
    health.check()
    health.check()
    assert not health.healthy(uuid)
    assert sample(sim, "gpu_agent_gpu_healthy", gpu="4", UUID=uuid) == 0
    unhealthy = [e for e in sim.events.since(0) if e.kind == "gpu.unhealthy"]
    assert len(unhealthy) == 1 and "GPU is lost" in unhealthy[0].message
