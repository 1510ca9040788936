"""The hardware layer reads exactly what the preset's hardware has."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.errors import NotFound
from agent.gpu import mig
from agent.gpu.inventory import GpuInventory, read_mig_devices
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.presets import PRESETS
from agent.gpu.types import Placement
from tests.gpu.conftest import SessionFactory


@pytest.mark.parametrize("preset", sorted(PRESETS))
async def test_inventory_equals_the_preset(open_session: SessionFactory, preset: str) -> None:
    node, session = open_session(preset)
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    spec = PRESETS[preset]
    gpus = inventory.gpus
    assert [g.uuid for g in gpus] == list(node.gpu_uuids())
    for i, gpu in enumerate(gpus):
        s = gpu.static
        assert (s.index, s.minor, s.name) == (i, i, spec.gpu.name)
        assert s.memory_total_mib == spec.gpu.memory_mib
        assert s.pci_bus_id == f"00000000:{spec.bus_numbers[i]:02X}:00.0"
        assert s.numa_node == spec.numa_nodes[i]
        cpus = spec.cpus.numa_cpus(spec.numa_nodes[i])
        # One run of cores per hardware thread: two with SMT (0-55,112-167), one without.
        runs = spec.cpus.threads_per_core
        step = len(cpus) // runs
        assert s.cpu_affinity == ",".join(f"{cpus[r * step]}-{cpus[r * step + step - 1]}"
                                          for r in range(runs))
        assert s.architecture == spec.gpu.architecture
        assert s.cuda_compute_capability == "{}.{}".format(*spec.gpu.cuda_capability)
        assert s.mig_capable == spec.gpu.mig_capable
        assert gpu.health.healthy
        assert gpu.mig_devices == ()
        assert (gpu.mig_mode is None) == (not spec.gpu.mig_capable)
    driver = inventory.driver
    assert driver.driver_version == spec.driver.version
    assert driver.cuda_driver_version == ("12.2" if preset == "dgx-a100-r535" else "12.8")


async def test_gi_profiles_and_placements_from_nvml(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    await session.initialise()
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    mig.set_mig_mode(session, handle, node.gpu_uuids()[0], True)
    inventory = GpuInventory(session)
    await inventory.load()
    profiles = {p.name: p for p in inventory.gpus[0].profiles}
    assert sorted(profiles) == ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb",
                                "4g.40gb", "7g.80gb"]
    assert [p.id for p in inventory.gpus[0].profiles] == [19, 14, 9, 5, 0, 20, 15]
    assert profiles["3g.40gb"].placements == (Placement(0, 4), Placement(4, 4))
    assert profiles["7g.80gb"].placements == (Placement(0, 8),)
    assert profiles["1g.20gb"].placements == tuple(Placement(s, 2) for s in (0, 2, 4, 6))
    assert profiles["1g.10gb+me"].media_extensions
    assert profiles["1g.20gb"].multiprocessors == 26


async def test_mig_devices_carry_profile_placement_and_max_sm_ci(
        open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    await session.initialise()
    uuid = node.gpu_uuids()[1]
    handle = node.nvml.nvmlDeviceGetHandleByIndex(1)
    mig.set_mig_mode(session, handle, uuid, True)
    three = mig.create_gpu_instance(session, handle, uuid, 9, Placement(4, 4))
    mig.create_compute_instance(session, handle, uuid, three)
    rev2 = mig.create_gpu_instance(session, handle, uuid, 15, Placement(0, 2))
    ci = mig.create_compute_instance(session, handle, uuid, rev2)
    assert ci.profile_id == 7  # the REV1 CI: all 26 SMs, not the first listed (16)
    bare = mig.create_gpu_instance(session, handle, uuid, 19, Placement(2, 1))
    inventory = GpuInventory(session)
    await inventory.load()
    gpu = inventory.find(uuid)
    assert {(d.profile, d.placement, d.multiprocessors) for d in gpu.mig_devices} == {
        ("3g.40gb", Placement(4, 4), 60), ("1g.20gb", Placement(0, 2), 26)}
    # The GI without a CI is no MIG device, but the per-profile walk sees it.
    instances = mig.read_instances(session, handle, uuid, gpu.profiles)
    assert {(g.id, g.placement, len(g.compute_instances)) for g in instances} == {
        (three, Placement(4, 4), 1), (rev2, Placement(0, 2), 1), (bare, Placement(2, 1), 0)}
    assert inventory.find("1") is gpu
    with pytest.raises(NotFound):
        inventory.find("9")


async def test_destroy_order_and_in_use(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    await session.initialise()
    uuid = node.gpu_uuids()[0]
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    mig.set_mig_mode(session, handle, uuid, True)
    gi = mig.create_gpu_instance(session, handle, uuid, 14, Placement(0, 2))
    mig.create_compute_instance(session, handle, uuid, gi)
    with pytest.raises(Exception, match="NVML_ERROR_IN_USE"):
        mig.destroy_gpu_instance(session, handle, uuid, gi)
    device = node.nvml.nvmlDeviceGetUUID(node.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    node.add_process(device, pid=4242, used_memory_mib=2048)
    assert mig.running_processes(session, handle, uuid)[0].gi_id == gi
    with pytest.raises(Exception, match="NVML_ERROR_IN_USE"):
        mig.destroy_compute_instances(session, handle, uuid, gi)
    node.remove_process(4242)
    mig.destroy_compute_instances(session, handle, uuid, gi)
    mig.destroy_gpu_instance(session, handle, uuid, gi)
    assert mig.read_instances(session, handle, uuid, ()) == ()


async def test_a_lost_gpu_is_unhealthy_and_the_rest_are_not(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    node.inject_xid(node.gpu_uuids()[5], 79)
    gpus = await inventory.refresh()
    assert [g.health.healthy for g in gpus] == [True] * 5 + [False] + [True] * 2
    assert "GPU_IS_LOST" in gpus[5].health.reasons[0]
    # Static attributes survive, so operators still see which GPU it was.
    assert gpus[5].static.pci_bus_id.endswith(":C3:00.0")


async def test_a_gpu_lost_before_start_is_listed_unhealthy(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    node.inject_xid(node.gpu_uuids()[0], 79)
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    lost = inventory.gpus[0]
    assert not lost.health.healthy
    assert lost.static.uuid == "GPU-LOST-0"
    assert all(g.health.healthy for g in inventory.gpus[1:])


async def test_a_walk_racing_destroys_skips_what_vanished(open_session: SessionFactory) -> None:
    """Reads run in the read pool while a GPU's mutations run on its own thread: an instance
    destroyed mid-walk is simply absent, never an error (found by the claims benchmark)."""
    node, session = open_session("dgx-h100")
    await session.initialise()
    uuid = node.gpu_uuids()[0]
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    mig.set_mig_mode(session, handle, uuid, True)
    inventory = GpuInventory(session)
    await inventory.load()
    profiles = inventory.gpus[0].profiles
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            gi = mig.create_gpu_instance(session, handle, uuid, 19, Placement(6, 1))
            mig.create_compute_instance(session, handle, uuid, gi)
            mig.destroy_compute_instances(session, handle, uuid, gi)
            mig.destroy_gpu_instance(session, handle, uuid, gi)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(200):
            mig.read_instances(session, handle, uuid, profiles)
            read_mig_devices(session, handle, uuid, profiles)
    finally:
        stop.set()
        worker.join()


class _Held:
    """The simulated NVML with one function's calls held at a gate while ``go`` is clear: a
    read caught between its walk of the instances and its MIG device handles."""

    def __init__(self, nvml: Any, function: str) -> None:
        self._nvml = nvml
        self._function = function
        self.reached = threading.Event()
        self.go = threading.Event()
        self.go.set()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._nvml, name)
        if name != self._function:
            return attribute

        def held(*args: Any) -> Any:
            if not self.go.is_set():
                self.reached.set()
                self.go.wait()
            return attribute(*args)
        return held


async def test_a_refresh_never_answers_with_a_read_begun_before_it(tmp_path: Path) -> None:
    """A caller that changed a GPU and then refreshes sees its change, even while a read
    begun before the change is still under way (the node spec once joined such a read)."""
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    held = _Held(node.nvml, "nvmlDeviceGetMigDeviceHandleByIndex")
    session = NvmlSession(held)
    try:
        await session.initialise()
        uuid = node.gpu_uuids()[0]
        handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
        mig.set_mig_mode(session, handle, uuid, True)
        mig.create_compute_instance(session, handle, uuid, mig.create_gpu_instance(
            session, handle, uuid, 19, Placement(0, 1)))
        inventory = GpuInventory(session)
        await inventory.load()
        held.go.clear()
        before = asyncio.ensure_future(inventory.refresh([uuid]))
        assert await asyncio.to_thread(held.reached.wait, 60), "the first read never walked"
        mig.create_compute_instance(session, handle, uuid, mig.create_gpu_instance(
            session, handle, uuid, 19, Placement(1, 1)))
        after = asyncio.ensure_future(inventory.refresh([uuid]))
        held.go.set()
        first, second = await asyncio.gather(before, after)
        assert [d.placement for d in first[0].mig_devices] == [Placement(0, 1)]
        assert [d.placement for d in second[0].mig_devices] == [Placement(0, 1), Placement(1, 1)]
        assert [d.placement for d in inventory.gpus[0].mig_devices] == \
            [Placement(0, 1), Placement(1, 1)]
    finally:
        session.close()
        node.close()


async def test_a_refresh_of_some_gpus_reads_only_those(open_session: SessionFactory) -> None:
    node, session = open_session("dgx-h100")
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    before = inventory.gpus
    calls = node.describe()["calls"]["nvmlDeviceGetMigMode"]
    gpus = await inventory.refresh([before[3].uuid])
    assert node.describe()["calls"]["nvmlDeviceGetMigMode"] == calls + 1
    assert [g.uuid for g in gpus] == [g.uuid for g in before]
    assert [g is b for g, b in zip(gpus, before, strict=True)] == \
        [True] * 3 + [False] + [True] * 4
    await inventory.refresh()
    assert node.describe()["calls"]["nvmlDeviceGetMigMode"] == calls + 1 + len(before)


async def test_a_gis_compute_profiles_are_read_once_a_session(
        open_session: SessionFactory) -> None:
    """They are fixed by the GPU and the GI's profile; asking every GI on every walk was a
    third of a slice prepare's NVML calls."""
    node, session = open_session("dgx-h100")
    await session.initialise()
    uuid = node.gpu_uuids()[0]
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    mig.set_mig_mode(session, handle, uuid, True)
    for start in range(3):
        mig.create_compute_instance(session, handle, uuid, mig.create_gpu_instance(
            session, handle, uuid, 19, Placement(start, 1)))
    profiles = (await _loaded(session)).gpus[0].profiles
    name = "nvmlGpuInstanceGetComputeInstanceProfileInfo"
    first = node.describe()["calls"][name]
    walked = mig.read_instances(session, handle, uuid, profiles)
    assert node.describe()["calls"][name] == first
    assert [len(g.compute_instances) for g in walked] == [1, 1, 1]


async def _loaded(session: NvmlSession) -> GpuInventory:
    inventory = GpuInventory(session)
    await inventory.load()
    return inventory


async def test_a_gi_destroyed_mid_walk_leaves_no_short_profile_list_behind(
        tmp_path: Path) -> None:
    """A walk that reads a GI's compute profiles while the GI is destroyed gets "not offered"
    for the rest (a stale handle answers INVALID_ARGUMENT); that short list is not remembered,
    so the next GI of the profile still shows its compute instance."""
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    held = _Held(node.nvml, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
    session = NvmlSession(held)
    try:
        await session.initialise()
        uuid = node.gpu_uuids()[0]
        handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
        mig.set_mig_mode(session, handle, uuid, True)
        profiles = (await _loaded(session)).gpus[0].profiles  # no GI walked: nothing cached
        gi = mig.create_gpu_instance(session, handle, uuid, 19, Placement(0, 1))
        held.go.clear()
        walk = asyncio.ensure_future(asyncio.to_thread(
            mig.read_instances, session, handle, uuid, profiles))
        assert await asyncio.to_thread(held.reached.wait, 30), "the walk never got there"
        mig.destroy_gpu_instance(session, handle, uuid, gi)
        held.go.set()
        await walk
        mig.create_compute_instance(session, handle, uuid, mig.create_gpu_instance(
            session, handle, uuid, 19, Placement(1, 1)))
        [made] = mig.read_instances(session, handle, uuid, profiles)
        assert len(made.compute_instances) == 1
    finally:
        session.close()
        node.close()
