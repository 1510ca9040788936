"""MIG transitions end to end in-process, over a simulated node through the real NVML layer."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.errors import Conflict, GeometryNotPlaceable, MigModeNeedsExplicit
from agent.events import EventLog
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Gpu, Placement
from agent.metrics.agent import AgentMetrics
from agent.mig.executor import GpuMutator
from agent.mig.geometry import (
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    Plan,
)
from agent.mig.journal import new_entry
from agent.mig.service import MigService
from agent.mig.transition import DrainPolicy, TransitionState
from tests.service_node import ServiceNode, open_services
from tests.waiting import until

MUTATIONS = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
             "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy",
             "nvmlGpuInstanceDestroy")
BALANCED = DesiredProfiles.of(["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])


@dataclass
class Node:
    sim: SimulatedNode
    session: NvmlSession
    inventory: GpuInventory
    mig: MigService
    events: EventLog
    metrics: AgentMetrics
    state_dir: Path
    services: ServiceNode

    async def gpu(self, index: int = 0) -> Gpu:
        await self.inventory.refresh()
        return self.inventory.find(str(index))

    async def geometry(self, index: int = 0) -> Geometry:
        geometry, _ = await self.mig.current(await self.gpu(index))
        return geometry

    async def change(self, desired: object, index: int = 0, **kwargs: object) -> TransitionState:
        outcome = await self.mig.request(await self.gpu(index), desired,  # type: ignore[arg-type]
                                         kwargs.pop("drain", DrainPolicy()),  # type: ignore[arg-type]
                                         **kwargs)  # type: ignore[arg-type]
        if outcome.transition is None:
            return TransitionState.SUCCEEDED
        await asyncio.wait_for(outcome.transition.finished.wait(), 30)
        return outcome.transition.state

    def calls(self) -> dict[str, int]:
        return dict(self.sim.describe()["calls"])


async def _open(tmp_path: Path, preset: str = "dgx-h100") -> Node:
    """The MIG side of a node built by the agent's wiring."""
    services = await open_services(tmp_path, preset=preset)
    n = services.node
    return Node(services.sim, n.session, n.inventory, n.mig, n.events, n.metrics,
                tmp_path / "state", services)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    opened = await _open(tmp_path)
    yield opened
    await opened.services.close()


def _layout(geometry: Geometry) -> list[str]:
    return [str(i) for i in geometry.instances]


async def test_off_to_balanced_and_back(node: Node) -> None:
    assert await node.change(BALANCED) == TransitionState.SUCCEEDED
    geometry = await node.geometry()
    assert geometry.mig_enabled
    assert sorted(_layout(geometry)) == sorted(
        ["3g.40gb@4:4", "2g.20gb@0:2", "1g.10gb@2:1", "1g.10gb@3:1"])
    assert [d.multiprocessors for d in (await node.gpu()).mig_devices if
            d.profile == "3g.40gb"] == [60]
    assert await node.change(DesiredDisabled()) == TransitionState.SUCCEEDED
    assert await node.geometry() == Geometry(mig_enabled=False)
    registry = node.metrics.registry
    assert registry.get_sample_value("gpu_agent_mig_transitions_total",
                                     {"result": "succeeded"}) == 2
    assert registry.get_sample_value("gpu_agent_mig_instances_destroyed_total") == 4


async def test_the_same_request_twice_makes_no_mutation(node: Node) -> None:
    await node.change(BALANCED)
    before = node.calls()
    outcome = await node.mig.request(await node.gpu(), BALANCED, DrainPolicy())
    assert outcome.plan.empty and outcome.transition is None
    after = node.calls()
    assert {f: after.get(f, 0) - before.get(f, 0) for f in MUTATIONS} == dict.fromkeys(
        MUTATIONS, 0)


async def test_impossible_geometry_is_rejected_and_changes_nothing(node: Node) -> None:
    with pytest.raises(GeometryNotPlaceable, match=r"no slice is left for 1g\.10gb"):
        await node.change(DesiredProfiles.of(["3g.40gb", "3g.40gb", "1g.10gb"]))
    assert not (await node.geometry()).mig_enabled
    assert node.calls().get("nvmlDeviceSetMigMode", 0) == 0


async def test_a_change_keeps_what_it_can_and_places_explicitly(node: Node) -> None:
    await node.change(BALANCED)
    kept = {i.gi_id for i in (await node.geometry()).instances if i.profile == "3g.40gb"}
    await node.change(DesiredProfiles.of(["3g.40gb", "1g.20gb", "1g.20gb"]))
    geometry = await node.geometry()
    assert {i.gi_id for i in geometry.instances if i.profile == "3g.40gb"} == kept
    assert sorted(_layout(geometry)) == ["1g.20gb@0:2", "1g.20gb@2:2", "3g.40gb@4:4"]


@pytest.mark.parametrize("function", MUTATIONS)
async def test_a_fault_at_any_mutation_rolls_back_exactly(node: Node, function: str) -> None:
    """Whichever mutation fails (every occurrence of it in turn), the GPU ends in its exact
    previous geometry, placements and CI profiles included."""
    await node.change(DesiredInstances((("3g.40gb", Placement(0, 4)),
                                        ("1g.10gb", Placement(6, 1)))))
    old = _layout(await node.geometry())
    old_cis = {i.gi_id: i for i in (await node.geometry()).instances}
    target = DesiredProfiles.of(["3g.40gb", "2g.20gb", "2g.20gb"])  # moves everything
    occurrence = 0
    while True:
        before = node.calls().get(function, 0)
        node.sim.add_fault(function, "NVML_ERROR_UNKNOWN", skip=occurrence)
        state = await node.change(target)
        node.sim.clear_faults()
        used = node.calls().get(function, 0) - before
        if used <= occurrence:  # the fault never fired: every occurrence has been tried
            assert state == TransitionState.SUCCEEDED
            break
        assert state == TransitionState.ROLLED_BACK, (function, occurrence)
        assert _layout(await node.geometry()) == old
        assert len(old_cis) == len((await node.geometry()).instances)
        occurrence += 1
    assert not list((node.state_dir / "mig" / "journal").glob("*.json"))


async def test_transient_in_use_is_retried(node: Node) -> None:
    node.sim.add_fault("nvmlDeviceCreateGpuInstanceWithPlacement", "NVML_ERROR_IN_USE", times=2)
    assert await node.change(BALANCED) == TransitionState.SUCCEEDED


async def test_rollback_failure_quarantines_the_gpu(node: Node) -> None:
    await node.change(BALANCED)
    node.sim.add_fault("nvmlDeviceCreateGpuInstanceWithPlacement", "NVML_ERROR_UNKNOWN",
                       times=1000)
    state = await node.change(DesiredProfiles.of(["7g.80gb"]))
    assert state == TransitionState.FAILED
    gpu = await node.gpu()
    reason = node.mig.quarantined(gpu.uuid)
    assert reason and "rollback" in reason
    with pytest.raises(Conflict, match="quarantined"):
        await node.change(DesiredDisabled())
    assert any(e.kind == "mig.quarantined" for e in node.events.since(0))


async def test_draining_fail_wait_and_timeout(node: Node) -> None:
    await node.change(BALANCED)
    gpu = await node.gpu()
    three = next(d for d in gpu.mig_devices if d.profile == "3g.40gb")
    one = next(d for d in gpu.mig_devices if d.profile == "1g.10gb")
    node.sim.add_process(three.uuid, pid=5001)
    node.sim.add_process(one.uuid, pid=5002)
    # A change that keeps the busy 3g (and moves nothing busy) goes ahead.
    keep_busy = DesiredProfiles.of(["3g.40gb"] + ["1g.10gb"] * 4)
    busy = {(d.profile, d.placement) for d in (three, one)}
    assert await node.change(keep_busy) == TransitionState.SUCCEEDED
    assert busy <= {(i.profile, i.placement) for i in (await node.geometry()).instances}
    # One that must destroy it: refused under fail, listing the blocker.
    seven = DesiredProfiles.of(["7g.80gb"])
    with pytest.raises(Conflict) as refused:
        await node.change(seven)
    assert "process 5001" in refused.value.detail
    # Under wait with a short timeout: aborted, drain marks gone, nothing changed.
    before = _layout(await node.geometry())
    assert await node.change(seven, drain=DrainPolicy("wait", 0.3)) == TransitionState.ABORTED
    assert _layout(await node.geometry()) == before
    assert node.mig.draining(gpu.uuid) == frozenset()
    # Under wait, it proceeds as soon as the processes leave.
    outcome = await node.mig.request(await node.gpu(), seven, DrainPolicy("wait", 30))
    transition = outcome.transition
    assert transition is not None
    await until(lambda: transition.state == TransitionState.DRAINING, "the transition to drain")
    assert node.mig.draining(gpu.uuid)
    node.sim.remove_process(5001)
    node.sim.remove_process(5002)
    await asyncio.wait_for(outcome.transition.finished.wait(), 30)
    assert outcome.transition.state == TransitionState.SUCCEEDED
    assert _layout(await node.geometry()) == ["7g.80gb@0:8"]


async def test_cancel_while_draining_aborts(node: Node) -> None:
    await node.change(BALANCED)
    busy = next(d for d in (await node.gpu()).mig_devices if d.profile == "2g.20gb")
    node.sim.add_process(busy.uuid, pid=6001)
    outcome = await node.mig.request(await node.gpu(), DesiredDisabled(),
                                     DrainPolicy("wait", 60))
    assert outcome.transition is not None
    with pytest.raises(Conflict, match="busy"):
        await node.change(BALANCED)
    cancelled = await node.mig.cancel(outcome.transition.id)
    assert cancelled.state == TransitionState.ABORTED
    assert "cancelled" in (cancelled.error or "")


async def test_ampere_needs_explicit_mode_and_reports_pending_reset(tmp_path: Path) -> None:
    node = await _open(tmp_path, "dgx-a100")
    try:
        trap = DesiredProfiles.of(["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"])
        with pytest.raises(MigModeNeedsExplicit, match="asked explicitly") as refused:
            await node.change(trap)
        assert refused.value.mig_enabled is True
        assert await node.change(trap, explicit_mode=True) == TransitionState.PENDING_RESET
        gpu = await node.gpu()
        assert gpu.mig_mode is not None and gpu.mig_mode.pending and not gpu.mig_mode.current
        node.sim.reset_gpu(gpu.uuid)  # what nvidia-smi -r does
        assert await node.change(trap) == TransitionState.SUCCEEDED
        assert len((await node.geometry()).instances) == 4
    finally:
        await node.services.close()


async def test_recovery_finishes_or_rolls_back_an_open_entry(node: Node) -> None:
    gpu = await node.gpu()
    await node.change(BALANCED)
    old = await node.geometry()
    # An entry as a crash leaves it: the plan recorded, the hardware not yet changed.
    plan_outcome = await node.mig.request(gpu, DesiredProfiles.of(["7g.80gb"]), DrainPolicy(),
                                          dry_run=True)
    node.mig.journal.write(new_entry(transition_id="t-crashed", gpu=gpu.uuid, old=old,
                                     old_ci_profiles={}, plan=plan_outcome.plan))
    await node.mig.recover()
    assert node.mig.transition("t-crashed").state == TransitionState.ROLLED_BACK
    assert _layout(await node.geometry()) == _layout(old)
    # An entry whose changes all landed: recovery finishes it.
    plan_outcome = await node.mig.request(gpu, DesiredDisabled(), DrainPolicy(), dry_run=True)
    await node.change(DesiredDisabled())
    node.mig.journal.write(new_entry(transition_id="t-done", gpu=gpu.uuid, old=old,
                                     old_ci_profiles={}, plan=plan_outcome.plan))
    await node.mig.recover()
    assert node.mig.transition("t-done").state == TransitionState.SUCCEEDED
    assert not (await node.geometry()).mig_enabled
    assert node.mig.journal.open_entries() == ([], [])


async def test_driver_reload_reapplies_and_drift_is_reported(tmp_path: Path) -> None:
    node = await _open(tmp_path)
    for gpu_state in node.sim.hardware.state.gpus:  # a driver loaded long ago
        gpu_state.energy_mj = 10**12
    await node.change(BALANCED)
    applied = _layout(await node.geometry())
    await node.services.stop()
    node.sim.reload_driver()  # Hopper forgets MIG mode and every instance
    node.sim.close()
    node = await _open(tmp_path)  # start-up reconciles: the geometry is re-applied
    try:
        transition = node.mig.transitions()[0]
        assert "MIG on" in transition.requested or "@" in transition.requested
        await asyncio.wait_for(transition.finished.wait(), 30)
        assert sorted(_layout(await node.geometry())) == sorted(applied)
        # Someone destroys an instance behind the agent's back: reported, not overwritten.
        gpu = await node.gpu()
        handle = node.sim.nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        victim = next(i for i in (await node.geometry()).instances if i.profile == "1g.10gb")
        gi = node.sim.nvml.nvmlDeviceGetGpuInstanceById(handle, victim.gi_id)
        cis = (node.sim.nvml.c_nvmlComputeInstance_t * 1)()
        count = ctypes.c_uint(1)
        node.sim.nvml.nvmlGpuInstanceGetComputeInstances(gi, 0, cis, ctypes.byref(count))
        node.sim.nvml.nvmlComputeInstanceDestroy(cis[0])
        node.sim.nvml.nvmlGpuInstanceDestroy(gi)
        await node.mig.check_drift()
        assert "left as it is" in (node.mig.drift(gpu.uuid) or "")
        assert len((await node.geometry()).instances) == 3
        assert node.metrics.registry.get_sample_value("gpu_agent_mig_geometry_drift",
                                                      {"gpu": gpu.uuid}) == 1
    finally:
        await node.services.close()


# A slice's change is verified on its own instances (walks of their profiles only), on a GPU
# at BALANCED: 3g.40gb@4:4, 2g.20gb@0:2, 1g.10gb@2:1, 1g.10gb@3:1.
SLICE_CHECKS = {
    "a made instance that is there": ((("3g.40gb", 4, 4),), (), True, None),
    "a made instance that is not there": ((("1g.10gb", 6, 1),), (), True,
                                          "1g.10gb@6:1 is not there"),
    "a destroyed instance that is gone": ((), (("1g.10gb", 6, 1),), True, None),
    "a destroyed instance still there": ((), (("2g.20gb", 0, 2),), True,
                                         "2g.20gb@0:2 is still there"),
    "MIG expected off": ((), (), False, "MIG mode is on, expected off"),
}


@pytest.mark.parametrize(("create", "destroy", "mig_after", "problem"), SLICE_CHECKS.values(),
                         ids=SLICE_CHECKS)
async def test_a_slice_change_is_verified_on_its_own_instances(
        node: Node, create: tuple, destroy: tuple, mig_after: bool, problem: str | None) -> None:
    assert await node.change(BALANCED) == TransitionState.SUCCEEDED
    gpu = await node.gpu()
    plan = Plan(keep=(), destroy=tuple(Instance(p, Placement(s, n)) for p, s, n in destroy),
                create=tuple(Instance(p, Placement(s, n)) for p, s, n in create),
                mig_enabled_before=True, mig_enabled_after=mig_after)
    mutator = GpuMutator(node.session, gpu.uuid, gpu.profiles)
    assert await node.session.read(lambda: mutator.verify_changes(plan)) == problem
