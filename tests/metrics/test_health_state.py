"""The fault store: faults survive an agent restart with their time, a reboot clears XIDs and
lost marks, unreadable state fails closed until an operator clears each GPU, a GPU lost
before the start is known by its index, and unregistered XID events are an informational
fault."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

from agent.events import EventLog
from agent.gpu.xid import XidEvent
from agent.health.taints import FaultClass, RecoveryAction, fault_class
from agent.metrics.agent import AgentMetrics
from agent.metrics.health import GpuHealth
from tests.metrics.conftest import Sim


def _health(sim: Sim, path: Path, *, boot: str = "boot-1", clock: list[float] | None = None,
            monitored: Collection[str] | None = None,
            lost: dict[str, str] | None = None) -> GpuHealth:
    now = clock if clock is not None else [1000.0]
    lost_marks = lost if lost is not None else {}
    return GpuHealth(events=sim.events, metrics=AgentMetrics(process=False),
                     lost_reason=lambda uuid: lost_marks.get(uuid) or sim.session.lost_reason(uuid),
                     state_path=path, boot_id=boot, monitored=lambda: monitored,
                     wall=lambda: now[0])


def _restart(health: GpuHealth, sim: Sim, path: Path, **kwargs: object) -> GpuHealth:
    health.close()  # the writes in flight, as the agent's stop waits for them
    again = _health(sim, path, **kwargs)  # type: ignore[arg-type]
    again.track(g.static for g in sim.inventory.gpus)
    return again


async def test_faults_survive_a_restart_with_their_time(sim: Sim, tmp_path: Path) -> None:
    """XIDs (with the GPU instance and the recovery action) and a lost mark come back after
    a restart on the same boot, each with the time it was first seen; a repeat of an XID
    keeps the first time; a cleared GPU stays clear."""
    path = tmp_path / "health" / "faults.json"
    clock = [1000.0]
    health = _health(sim, path, clock=clock)
    health.track(g.static for g in sim.inventory.gpus)
    a, b, c = sim.node.gpu_uuids()[:3]
    health.record_xid(XidEvent(a, 48, recovery_action=int(RecoveryAction.GPU_RESET)))
    clock[0] = 2000.0
    health.record_xid(XidEvent(a, 48))  # the same XID again: its first time stays
    health.record_xid(XidEvent(b, 94, gi_id=3, ci_id=0))
    health.record_xid(XidEvent(c, 13))
    before = {u: health.faults(u) for u in (a, b, c)}
    health.clear(c, why="reset")
    again = _restart(health, sim, path, clock=[5000.0])
    assert again.faults(a) == before[a]
    assert [(f.since, f.recovery_action) for f in again.faults(a)] == [
        (1000.0, RecoveryAction.GPU_RESET)]
    assert again.faults(b) == before[b] and again.faults(b)[0].gi_id == 3
    assert again.faults(c) == ()


async def test_a_reboot_clears_xids_and_lost_marks(sim: Sim, tmp_path: Path) -> None:
    """A new boot id: the GPUs were reset by the reboot, so their XIDs are gone."""
    path = tmp_path / "faults.json"
    health = _health(sim, path)
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[0]
    health.record_xid(XidEvent(uuid, 79))
    assert _restart(health, sim, path, boot="boot-1").faults(uuid) != ()
    assert _restart(health, sim, path, boot="boot-2").faults(uuid) == ()


async def test_a_lost_gpu_keeps_its_first_time_even_named_anew(sim: Sim,
                                                               tmp_path: Path) -> None:
    """A GPU lost before the next start is listed by NVML under no UUID (a placeholder,
    minor -1): matched by its index, it keeps its lost fault's time and XIDs, and its
    identity (UUID, minor) names its device. Once it answers again the lost mark goes."""
    path = tmp_path / "faults.json"
    clock = [1000.0]
    gpus = [g.static for g in sim.inventory.gpus]
    real = gpus[5]
    lost = {real.uuid: "nvmlDeviceGetPowerUsage returned NVML_ERROR_GPU_IS_LOST"}
    health = _health(sim, path, clock=clock, lost=lost)
    health.track(gpus)
    health.record_xid(XidEvent(real.uuid, 79))
    first = health.faults(real.uuid)
    assert [(f.kind, f.since) for f in first] == [("gpu-lost", 1000.0), ("xid", 1000.0)]
    health.close()
    placeholder = dataclasses.replace(real, uuid="GPU-LOST-5", minor=-1)
    again = _health(sim, path, clock=[9000.0], lost={"GPU-LOST-5": "at start-up"})
    again.track([*gpus[:5], placeholder, *gpus[6:]])
    assert [(f.kind, f.since) for f in again.faults("GPU-LOST-5")] == [
        ("gpu-lost", 1000.0), ("xid", 1000.0)]
    assert again.identity("GPU-LOST-5") == (real.uuid, real.minor)
    assert again.identity(gpus[0].uuid) is None
    back = _health(sim, path, clock=[9500.0])
    back.track(gpus)  # it answers again: the lost mark goes, the XID stays until a reset
    assert [f.kind for f in back.faults(real.uuid)] == ["xid"]


async def test_unreadable_health_state_fails_closed_until_cleared(sim: Sim,
                                                                 tmp_path: Path) -> None:
    """A damaged file is kept aside; every GPU gets a blocking fault naming it (an error
    event says so), durably, until an operator clears that GPU."""
    path = tmp_path / "faults.json"
    path.write_text("not an envelope")
    health = _health(sim, path)
    assert health.problem is not None and "faults.json" in health.problem
    health.track(g.static for g in sim.inventory.gpus)
    uuids = sim.node.gpu_uuids()
    for uuid in uuids:
        (fault,) = health.faults(uuid)
        assert fault.kind == "quarantined" and "faults.json" in fault.reason
        assert fault_class(fault) is FaultClass.BLOCKING and not health.healthy(uuid)
    assert list(tmp_path.glob("faults.json.*"))  # noqa: ASYNC240 - kept aside
    assert [e.kind for e in sim.events.since(0)].count("gpu.health_state_unreadable") == 1
    health.clear(uuids[0], why="checked by hand")
    assert health.faults(uuids[0]) == ()
    again = _restart(health, sim, path)
    assert again.problem is None
    assert again.faults(uuids[0]) == ()
    assert [f.kind for f in again.faults(uuids[1])] == ["quarantined"]


async def test_gpus_whose_xid_events_are_not_registered_are_unmonitored(
        sim: Sim, tmp_path: Path) -> None:
    """Once registration ended, a GPU missing from it has an informational unmonitored
    fault (its time stays); before registration ended nothing is claimed."""
    uuids = sim.node.gpu_uuids()
    watched: list[Collection[str] | None] = [None]
    health = GpuHealth(events=EventLog(), metrics=AgentMetrics(process=False),
                       lost_reason=sim.session.lost_reason, monitored=lambda: watched[0])
    health.track(g.static for g in sim.inventory.gpus)
    assert health.faults(uuids[1]) == ()
    watched[0] = tuple(uuids[:1])
    (fault,) = health.faults(uuids[1])
    assert fault.kind == "unmonitored" and fault_class(fault) is FaultClass.INFORMATIONAL
    assert health.faults(uuids[1]) == (fault,)
    assert health.faults(uuids[0]) == () and health.healthy(uuids[1])


async def test_a_state_the_disk_refuses_is_reported_and_kept_in_memory(
        sim: Sim, tmp_path: Path) -> None:
    """A state directory that cannot be written: the fault holds in memory (its taint is
    published) and an error event says it does not survive a restart."""
    health = _health(sim, tmp_path / "health" / "faults.json")
    (tmp_path / "health").write_text("")  # a file where the directory belongs
    health.track(g.static for g in sim.inventory.gpus)
    uuid = sim.node.gpu_uuids()[0]
    health.record_xid(XidEvent(uuid, 48))
    health.close()
    assert [f.value for f in health.faults(uuid)] == ["48"]
    assert "gpu.health_state_unwritable" in [e.kind for e in sim.events.since(0)]
