"""The GPU's recovery action through the hardware layer, over the simulated NVML: the XID
watcher fills each event with it (None on a driver without it, logged once per GPU), and
``read_recovery_action`` answers it on its own for start-up."""

from __future__ import annotations

import logging

import pytest

from agent.gpu.inventory import read_static
from agent.gpu.recovery import read_recovery_action
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import GpuStatic
from agent.gpu.xid import XidEvent, XidWatcher
from tests.waiting import until

from .conftest import SessionFactory

RESET, REBOOT, DRAIN_P2P = 1, 2, 3


async def _watching(open_session: SessionFactory, preset: str
                    ) -> tuple[SimulatedNode, NvmlSession, XidWatcher, list[XidEvent]]:
    node, session = open_session(preset)
    await session.initialise()
    received: list[XidEvent] = []
    watcher = XidWatcher(session, received.append, wait_ms=50)
    watcher.start(await session.read(lambda: _statics(session, node)))
    await until(lambda: len(watcher.registered) == 8, "every GPU registered")
    return node, session, watcher, received


def _statics(session: NvmlSession, node: SimulatedNode) -> list[GpuStatic]:
    return [read_static(session, index) for index in range(len(node.gpu_uuids()))]


async def test_each_xid_event_carries_the_action_read_right_after_it(
        open_session: SessionFactory) -> None:
    """Driver 570: the action the XID left (or the one named), the GPU's for a MIG
    device's XID; None for a GPU fallen off the bus, which answers no NVML call."""
    node, _, watcher, received = await _watching(open_session, "dgx-h100")
    try:
        uuids = node.gpu_uuids()
        node.inject_xid(uuids[3], 48)
        node.inject_xid(uuids[0], 31)
        node.inject_xid(uuids[3], 31)  # the GPU still needs its reset
        node.inject_xid(uuids[5], 13, "reboot")
        node.inject_xid(uuids[6], 74)
        node.inject_xid(uuids[7], 79)
        await until(lambda: len(received) == 6, "the six XIDs")
        assert [(e.gpu_uuid, e.xid, e.recovery_action) for e in received] == [
            (uuids[3], 48, RESET), (uuids[0], 31, 0), (uuids[3], 31, RESET),
            (uuids[5], 13, REBOOT), (uuids[6], 74, DRAIN_P2P), (uuids[7], 79, None)]
    finally:
        watcher.stop()


async def test_an_older_driver_gives_none_and_says_so_once_per_gpu(
        open_session: SessionFactory, caplog: pytest.LogCaptureFixture) -> None:
    """Driver 535 answers NOT_SUPPORTED in the field: every event carries None, and the
    reason is logged once for each GPU however many XIDs it raises."""
    caplog.set_level(logging.INFO, logger="agent.gpu.recovery")
    node, _, watcher, received = await _watching(open_session, "dgx-a100-r535")
    try:
        uuids = node.gpu_uuids()
        for _ in range(3):
            node.inject_xid(uuids[1], 48)
        node.inject_xid(uuids[2], 31)
        await until(lambda: len(received) == 4, "the four XIDs")
        assert [e.recovery_action for e in received] == [None] * 4
    finally:
        watcher.stop()
    told = [r for r in caplog.records if r.name == "agent.gpu.recovery"]
    assert sorted(r.__dict__["gpu"] for r in told) == sorted([uuids[1], uuids[2]])
    assert {r.levelno for r in told} == {logging.INFO}


async def test_read_recovery_action_for_start_up(open_session: SessionFactory,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """What the driver holds now (a GPU that needed a reset before the agent started still
    does), back to 0 after a reset; None, with a warning, when the read fails."""
    node, session = open_session("dgx-h100")
    await session.initialise()
    uuids = node.gpu_uuids()
    node.inject_xid(uuids[2], 119)
    assert await session.read(lambda: read_recovery_action(session, uuids[2])) == RESET
    assert await session.read(lambda: read_recovery_action(session, uuids[1])) == 0
    node.reset_gpu(uuids[2])
    assert await session.read(lambda: read_recovery_action(session, uuids[2])) == 0
    node.add_fault("nvmlDeviceGetFieldValues", "NVML_ERROR_UNKNOWN", uuids[4])
    caplog.set_level(logging.INFO, logger="agent.gpu.recovery")
    assert await session.read(lambda: read_recovery_action(session, uuids[4])) is None
    [record] = [r for r in caplog.records if r.name == "agent.gpu.recovery"]
    assert record.levelno == logging.WARNING
    assert record.__dict__["error"] == "NVML_ERROR_UNKNOWN"
    node.inject_xid(uuids[6], 79)
    assert await session.read(lambda: read_recovery_action(session, uuids[6])) is None
    assert session.lost_reason(uuids[6]) is not None  # the read saw it lost


async def test_read_recovery_action_on_the_older_driver(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-a100-r535")
    await session.initialise()
    node.inject_xid(node.gpu_uuids()[0], 48)
    assert await session.read(lambda: read_recovery_action(session, node.gpu_uuids()[0])) \
        is None
