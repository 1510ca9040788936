"""The simulated ``nvmlDeviceGetGpuFabricInfo(V)``: which presets have an NVLink fabric, what a
healthy one reports, the NVLink domain a node's flags put it in, and the fabric faults."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.errors import Conflict, InvalidRequest
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.presets import NVL72_CLIQUE_ID, NVL72_CLUSTER_UUID

from .conftest import NodeFactory, create_gi, enable_mig

COMPLETED = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
SUCCESS = pynvml.NVML_SUCCESS
ZERO = bytes(16)
NVL72 = bytes.fromhex(NVL72_CLUSTER_UUID.replace("-", ""))
# Healthy Blackwell mask: degraded bandwidth, route recovery, route unhealthy and access
# timeout recovery FALSE (2 each), incorrect configuration NONE (1).
HEALTHY_MASK = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8
DEGRADED_MASK = 1 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8


def opened(node: SimulatedNode) -> SimulatedNode:
    """A node opened here (not by ``make_node``), its NVML initialised."""
    node.nvml.nvmlInit()
    return node


def fabric_info(node: SimulatedNode, index: int = 0) -> Any:
    info = pynvml.c_nvmlGpuFabricInfo_v3_t()
    handle = node.nvml.nvmlDeviceGetHandleByIndex(index)
    assert node.nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info)) == SUCCESS
    return info


def answer(info: Any) -> tuple[bytes, int, int, int, int, int]:
    return (bytes(info.clusterUuid), info.cliqueId, info.state, info.status, info.healthMask,
            info.healthSummary)


@pytest.mark.parametrize(("preset", "expected"), [
    # Hopper on NVSwitch: registered with the fabric manager, no multi-node NVLink.
    ("dgx-h100", (ZERO, 0, COMPLETED, SUCCESS, 0,
                  pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED)),
    ("hgx-h200", (ZERO, 0, COMPLETED, SUCCESS, 0,
                  pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED)),
    ("gb200-nvl72", (NVL72, NVL72_CLIQUE_ID, COMPLETED, SUCCESS, HEALTHY_MASK,
                     pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)),
])
def test_a_healthy_fabric_per_preset(make_node: NodeFactory, preset: str,
                                     expected: tuple[Any, ...]) -> None:
    """Every GPU of a fabric preset reports the same completed fabric."""
    node = make_node(preset)
    for index in range(node.preset.gpu_count):
        assert answer(fabric_info(node, index)) == expected


@pytest.mark.parametrize("preset", ["dgx-a100", "dgx-a100-r535", "a100-pcie-bridged", "l40s"])
def test_gpus_before_hopper_or_off_nvswitch_have_no_fabric(make_node: NodeFactory,
                                                           preset: str) -> None:
    """Ampere and Ada answer NOT_SUPPORTED to both calls, as real NVML does."""
    node = make_node(preset)
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.nvml.nvmlDeviceGetGpuFabricInfoV(handle,
                                              ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))


def test_the_unversioned_call_and_the_v2_struct(make_node: NodeFactory) -> None:
    """The deprecated call fills the v1 struct (no mask); V takes v2 (mask) and v3."""
    node = make_node("gb200-nvl72")
    handle = node.nvml.nvmlDeviceGetHandleByIndex(1)
    old = pynvml.c_nvmlGpuFabricInfo_t()
    assert node.nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(old)) == SUCCESS
    assert (bytes(old.clusterUuid), old.cliqueId, old.state, old.status) == (
        NVL72, NVL72_CLIQUE_ID, COMPLETED, SUCCESS)
    v2 = pynvml.c_nvmlGpuFabricInfoV_t()
    node.nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(v2))
    assert v2.healthMask == HEALTHY_MASK


def test_a_mig_device_handle_has_no_fabric(make_node: NodeFactory) -> None:
    node = make_node("gb200-nvl72")
    handle = enable_mig(node)
    gi = create_gi(node, handle, 19)
    node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig = node.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.nvml.nvmlDeviceGetGpuFabricInfoV(mig, ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))
    assert fabric_info(node).state == COMPLETED  # the GPU itself still answers


FAULTS = [
    # condition, status, -> (UUID, clique, state, status, mask, summary)
    ("not-started", None, (ZERO, 0, pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, SUCCESS,
                           HEALTHY_MASK, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)),
    ("in-progress", None, (ZERO, 0, pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, SUCCESS,
                           HEALTHY_MASK, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)),
    ("failed", None, (ZERO, 0, COMPLETED, pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
                      HEALTHY_MASK, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY)),
    ("failed", "TIMEOUT", (ZERO, 0, COMPLETED, pynvml.NVML_ERROR_TIMEOUT, HEALTHY_MASK,
                           pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY)),
    ("degraded", None, (NVL72, NVL72_CLIQUE_ID, COMPLETED, SUCCESS, DEGRADED_MASK,
                        pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY)),
    ("completed", None, (NVL72, NVL72_CLIQUE_ID, COMPLETED, SUCCESS, HEALTHY_MASK,
                         pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)),
]


@pytest.mark.parametrize(("condition", "status", "expected"), FAULTS,
                         ids=[f"{c}-{s}" for c, s, _ in FAULTS])
def test_a_fabric_fault_changes_one_gpu(make_node: NodeFactory, condition: str,
                                        status: str | None, expected: tuple[Any, ...]) -> None:
    """A fabric fault on GPU 2 changes what GPU 2 reports, and only that."""
    node = make_node("gb200-nvl72")
    healthy = answer(fabric_info(node, 0))
    node.set_fabric(node.gpu_uuids()[2], condition, status)
    assert answer(fabric_info(node, 2)) == expected
    assert [answer(fabric_info(node, i)) for i in (0, 1, 3)] == [healthy] * 3


def test_a_fault_on_hopper_degrades_only_the_bandwidth_field(make_node: NodeFactory) -> None:
    """Hopper reports no health fields (0) until one says TRUE."""
    node = make_node("dgx-h100")
    node.set_fabric(node.gpu_uuids()[0], "degraded")
    assert fabric_info(node).healthMask == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE


def test_a_fabric_fault_survives_a_restart_of_the_node(tmp_path: Path) -> None:
    """The condition is the driver's: it is in the persisted hardware state."""
    with SimulatedNode("gb200-nvl72", tmp_path / "s", tmp_path / "p") as node:
        node.set_fabric(node.gpu_uuids()[3], "in-progress")
    with SimulatedNode("gb200-nvl72", tmp_path / "s", tmp_path / "p") as again:
        assert fabric_info(opened(again), 3).state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
        assert again.describe()["gpus"][3]["fabric"] == "in-progress"


@pytest.mark.parametrize(("condition", "status", "field"), [
    ("lost", None, "condition"),
    ("degraded", "TIMEOUT", "status"),  # only a failed fabric has an error status
    ("failed", "NVML_ERROR_NO_SUCH_THING", "status"),
    ("failed", "SUCCESS", "status"),
])
def test_bad_fabric_faults_are_refused(make_node: NodeFactory, condition: str,
                                       status: str | None, field: str) -> None:
    node = make_node("gb200-nvl72")
    with pytest.raises(InvalidRequest) as excinfo:
        node.set_fabric(node.gpu_uuids()[0], condition, status)
    assert excinfo.value.errors[0]["field"] == field
    assert answer(fabric_info(node))[2] == COMPLETED  # nothing changed


def test_a_preset_without_fabric_refuses_fabric_faults(make_node: NodeFactory) -> None:
    node = make_node("l40s")
    with pytest.raises(Conflict, match="no NVLink fabric"):
        node.set_fabric(node.gpu_uuids()[0], "in-progress")


CLUSTER = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"


def test_nodes_given_the_same_cluster_and_clique_form_one_domain(tmp_path: Path) -> None:
    """Two nodes started with the same flags report the same (cluster UUID, clique); a third
    with another clique id is in the same cluster, another clique."""
    def open_node(name: str, clique: int) -> SimulatedNode:
        return opened(SimulatedNode("gb200-nvl72", tmp_path / name, tmp_path / f"{name}-proc",
                                    cluster_uuid=CLUSTER, clique_id=clique))

    with open_node("a", 7) as a, open_node("b", 7) as b, open_node("c", 8) as c:
        domain = bytes.fromhex(CLUSTER.replace("-", ""))
        assert [answer(fabric_info(n))[:2] for n in (a, b, c)] == [
            (domain, 7), (domain, 7), (domain, 8)]
        # A node's GPUs are its own (UUIDs differ) while the domain is shared.
        assert set(a.gpu_uuids()).isdisjoint(b.gpu_uuids())


def test_a_clique_flag_alone_keeps_the_presets_cluster(tmp_path: Path) -> None:
    with SimulatedNode("gb200-nvl72", tmp_path / "s", tmp_path / "p", clique_id=3) as node:
        assert answer(fabric_info(opened(node)))[:2] == (NVL72, 3)


@pytest.mark.parametrize(("preset", "kwargs", "field", "message"), [
    ("gb200-nvl72", {"cluster_uuid": "not-a-uuid"}, "sim_cluster_uuid", "not a non-zero UUID"),
    ("gb200-nvl72", {"cluster_uuid": "00000000-0000-0000-0000-000000000000"},
     "sim_cluster_uuid", "not a non-zero UUID"),
    ("gb200-nvl72", {"clique_id": 1 << 32}, "sim_clique_id", "from 0 to 4294967295"),
    ("dgx-h100", {"clique_id": 3}, "sim_clique_id", "give --sim-cluster-uuid too"),
    ("l40s", {"cluster_uuid": CLUSTER}, "sim_cluster_uuid", "has no NVLink fabric"),
    ("dgx-a100", {"clique_id": 3}, "sim_clique_id", "has no NVLink fabric"),
])
def test_bad_domain_flags_are_refused_before_the_node_opens(
        tmp_path: Path, preset: str, kwargs: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as excinfo:
        SimulatedNode(preset, tmp_path / "s", tmp_path / "p", **kwargs)
    assert excinfo.value.errors[0]["field"] == field
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_hopper_given_a_cluster_reports_it(tmp_path: Path) -> None:
    """An H100 on an NVLink network (NVLink Switch System) reports its cluster too."""
    with SimulatedNode("dgx-h100", tmp_path / "s", tmp_path / "p", cluster_uuid=CLUSTER,
                       clique_id=2) as node:
        assert answer(fabric_info(opened(node)))[:3] == (
            bytes.fromhex(CLUSTER.replace("-", "")), 2, COMPLETED)
