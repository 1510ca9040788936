"""The inventory reads each GPU's NVLink fabric through the one NVML door into
:class:`~agent.gpu.types.Fabric`, re-read on every refresh; the API shows it as FabricModel."""

from __future__ import annotations

import pytest

from agent.api.models import FabricModel
from agent.gpu.fabric import health_flags
from agent.gpu.inventory import GpuInventory
from agent.gpu.sim.presets import NVL72_CLIQUE_ID, NVL72_CLUSTER_UUID
from agent.gpu.types import Fabric
from tests.gpu.conftest import SessionFactory

HEALTHY_MASK = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8
ZERO_UUID = "00000000-0000-0000-0000-000000000000"


async def inventory_of(open_session: SessionFactory, preset: str) -> GpuInventory:
    _, session = open_session(preset)
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    return inventory


@pytest.mark.parametrize(("preset", "expected"), [
    ("gb200-nvl72", Fabric(cluster_uuid=NVL72_CLUSTER_UUID, clique_id=NVL72_CLIQUE_ID, state=3,
                           status=0, health_mask=HEALTHY_MASK)),
    ("dgx-h100", Fabric(cluster_uuid=ZERO_UUID, clique_id=0, state=3, status=0, health_mask=0)),
    ("dgx-a100", None),
    ("l40s", None),
])
async def test_each_gpu_carries_its_fabric(open_session: SessionFactory, preset: str,
                                           expected: Fabric | None) -> None:
    inventory = await inventory_of(open_session, preset)
    assert [g.fabric for g in inventory.gpus] == [expected] * len(inventory.gpus)
    assert all(g.health.healthy for g in inventory.gpus)


@pytest.mark.parametrize(("condition", "expected"), [
    # condition -> (state, status, cluster UUID, health, clique)
    ("completed", ("completed", "NVML_SUCCESS", NVL72_CLUSTER_UUID, (),
                   f"{NVL72_CLUSTER_UUID}.{NVL72_CLIQUE_ID}")),
    ("not-started", ("not_started", "NVML_SUCCESS", ZERO_UUID, (), None)),
    ("in-progress", ("in_progress", "NVML_SUCCESS", ZERO_UUID, (), None)),
    ("failed", ("completed", "NVML_ERROR_INSUFFICIENT_RESOURCES", ZERO_UUID, (), None)),
    ("degraded", ("completed", "NVML_SUCCESS", NVL72_CLUSTER_UUID, ("degraded_bandwidth",),
                  f"{NVL72_CLUSTER_UUID}.{NVL72_CLIQUE_ID}")),
])
async def test_a_refresh_reads_the_fabric_afresh(
        open_session: SessionFactory, condition: str, expected: tuple[object, ...]) -> None:
    """A fabric that changes behind the agent (the fabric manager) shows at the next refresh;
    a fabric problem is the fabric's, not a GPU health problem."""
    node, session = open_session("gb200-nvl72")
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    node.set_fabric(node.gpu_uuids()[1], condition)
    fabric = (await inventory.refresh())[1].fabric
    assert fabric is not None
    assert (fabric.state_name, fabric.status_name, fabric.cluster_uuid, fabric.health,
            fabric.clique) == expected
    assert inventory.gpus[1].health.healthy


async def test_a_driver_without_the_versioned_call_answers_through_the_old_one(
        open_session: SessionFactory) -> None:
    """FUNCTION_NOT_FOUND for ...V: the unversioned call, which has no health mask."""
    node, session = open_session("gb200-nvl72")
    node.add_fault("nvmlDeviceGetGpuFabricInfoV", "NVML_ERROR_FUNCTION_NOT_FOUND", times=4)
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    assert [g.fabric for g in inventory.gpus] == [Fabric(
        cluster_uuid=NVL72_CLUSTER_UUID, clique_id=NVL72_CLIQUE_ID, state=3, status=0,
        health_mask=None)] * 4


async def test_an_unreadable_fabric_is_none_and_the_gpu_stays_healthy(
        open_session: SessionFactory) -> None:
    node, session = open_session("gb200-nvl72")
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    node.add_fault("nvmlDeviceGetGpuFabricInfoV", "NVML_ERROR_UNKNOWN", gpu=node.gpu_uuids()[0])
    gpus = await inventory.refresh()
    assert gpus[0].fabric is None and gpus[0].health.healthy
    assert gpus[1].fabric is not None


async def test_a_lost_gpu_is_unhealthy_not_fabricless(open_session: SessionFactory) -> None:
    node, session = open_session("gb200-nvl72")
    await session.initialise()
    inventory = GpuInventory(session)
    await inventory.load()
    node.add_fault("nvmlDeviceGetGpuFabricInfoV", "NVML_ERROR_GPU_IS_LOST",
                   gpu=node.gpu_uuids()[2])
    gpus = await inventory.refresh()
    assert not gpus[2].health.healthy
    assert "GPU_IS_LOST" in gpus[2].health.reasons[0]


@pytest.mark.parametrize(("mask", "flags"), [
    (0, ()),  # every field NOT_SUPPORTED (Hopper)
    (HEALTHY_MASK, ()),
    (HEALTHY_MASK & ~0x3 | 1, ("degraded_bandwidth",)),
    (HEALTHY_MASK & ~(0x3 << 4) | 1 << 4, ("route_unhealthy",)),
    (1 | 1 << 2 | 1 << 6, ("degraded_bandwidth", "route_recovery", "access_timeout_recovery")),
    (HEALTHY_MASK & ~(0xF << 8) | 4 << 8, ("incorrect_configuration",)),  # NO_PARTITION
])
def test_health_mask_flags(mask: int, flags: tuple[str, ...]) -> None:
    assert health_flags(mask) == flags


@pytest.mark.parametrize(("fabric", "expected"), [
    (Fabric(cluster_uuid=NVL72_CLUSTER_UUID, clique_id=4, state=3, status=0,
            health_mask=HEALTHY_MASK),
     {"state": "completed", "status": "NVML_SUCCESS", "cluster_uuid": NVL72_CLUSTER_UUID,
      "clique_id": 4, "clique": f"{NVL72_CLUSTER_UUID}.4", "health_mask": HEALTHY_MASK,
      "health": []}),
    # A zero cluster UUID is no cluster: no UUID, no clique id (Hopper without MNNVL).
    (Fabric(cluster_uuid=ZERO_UUID, clique_id=0, state=3, status=0, health_mask=0),
     {"state": "completed", "status": "NVML_SUCCESS", "cluster_uuid": None, "clique_id": None,
      "clique": None, "health_mask": 0, "health": []}),
    (Fabric(cluster_uuid=NVL72_CLUSTER_UUID, clique_id=4, state=3, status=25,
            status_name="NVML_ERROR_INSUFFICIENT_RESOURCES", health_mask=None),
     {"state": "completed", "status": "NVML_ERROR_INSUFFICIENT_RESOURCES",
      "cluster_uuid": NVL72_CLUSTER_UUID, "clique_id": 4, "clique": None, "health_mask": None,
      "health": []}),
    (Fabric(cluster_uuid=NVL72_CLUSTER_UUID, clique_id=4, state=2, status=0,
            health_mask=1, health=("degraded_bandwidth",)),
     {"state": "in_progress", "status": "NVML_SUCCESS", "cluster_uuid": NVL72_CLUSTER_UUID,
      "clique_id": 4, "clique": None, "health_mask": 1, "health": ["degraded_bandwidth"]}),
])
def test_the_api_model_of_a_fabric(fabric: Fabric, expected: dict[str, object]) -> None:
    assert FabricModel.of(fabric).model_dump() == expected
