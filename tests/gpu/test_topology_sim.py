"""The simulated NVML's interconnect calls answer as NVML does: values, and error codes for
links that are not there, bad arguments, lost GPUs and unsupported fabric info."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.gpu.sim.node import SimulatedNode


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, SimulatedNode]]:
    opened = {p: SimulatedNode(p, tmp_path / p / "s", tmp_path / p / "p")
              for p in ("dgx-h100", "a100-pcie-bridged", "l40s")}
    for node in opened.values():
        node.nvml.nvmlInit()
    yield opened
    for node in opened.values():
        node.close()


def test_link_calls(nodes: dict[str, SimulatedNode]) -> None:
    nvml = nodes["dgx-h100"].nvml
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetNvLinkState(gpu, 17) == pynvml.NVML_FEATURE_ENABLED
    assert nvml.nvmlDeviceGetNvLinkVersion(gpu, 0) == pynvml.NVML_NVLINK_VERSION_4_0
    assert nvml.nvmlDeviceGetNvLinkCapability(gpu, 0, pynvml.NVML_NVLINK_CAP_P2P_SUPPORTED) == 1
    assert nvml.nvmlDeviceGetNvLinkRemoteDeviceType(gpu, 12) == (
        pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
    assert nvml.nvmlDeviceGetNvLinkRemotePciInfo(gpu, 12).busId == "00000000:08:00.0"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(gpu, 18)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(gpu, pynvml.NVML_NVLINK_MAX_LINKS)
    l40s = nodes["l40s"].nvml
    with pytest.raises(pynvml.NVMLError_NotSupported):
        l40s.nvmlDeviceGetNvLinkState(l40s.nvmlDeviceGetHandleByIndex(0), 0)
    bridged = nodes["a100-pcie-bridged"].nvml
    remote = bridged.nvmlDeviceGetNvLinkRemotePciInfo(bridged.nvmlDeviceGetHandleByIndex(1), 5)
    assert remote.busId == "00000000:65:00.0"  # GPU 3, its bridge partner


def test_pair_calls(nodes: dict[str, SimulatedNode]) -> None:
    nvml = nodes["a100-pcie-bridged"].nvml
    g0, g1, g2, g4 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1, 2, 4))
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(g0, g1) == pynvml.NVML_TOPOLOGY_NODE
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(g0, g4) == pynvml.NVML_TOPOLOGY_SYSTEM
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetTopologyCommonAncestor(g0, g0)
    nvlink = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    assert nvml.nvmlDeviceGetP2PStatus(g0, g2, nvlink) == pynvml.NVML_P2P_STATUS_OK
    assert nvml.nvmlDeviceGetP2PStatus(g0, g1, nvlink) == pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
    assert nvml.nvmlDeviceGetP2PStatus(g0, g1, 0) == pynvml.NVML_P2P_STATUS_OK
    assert nvml.nvmlDeviceGetP2PStatus(g0, g4, 0) == (
        pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED)


def test_fabric_and_pcie(nodes: dict[str, SimulatedNode]) -> None:
    nvml = nodes["dgx-h100"].nvml
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    assert nvml.nvmlDeviceGetGpuFabricInfoV(gpu, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert bytes(info.clusterUuid) == bytes(16)
    stale = pynvml.c_nvmlGpuFabricInfoV_t()
    stale.version = 1
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetGpuFabricInfoV(gpu, ctypes.byref(stale))
    assert nvml.nvmlDeviceGetMaxPcieLinkGeneration(gpu) == 5
    assert nvml.nvmlDeviceGetMaxPcieLinkWidth(gpu) == 16
    assert nvml.nvmlDeviceGetCurrPcieLinkGeneration(gpu) == 1  # idle: trained down
    ampere = nodes["a100-pcie-bridged"].nvml
    with pytest.raises(pynvml.NVMLError_NotSupported):
        ampere.nvmlDeviceGetGpuFabricInfoV(ampere.nvmlDeviceGetHandleByIndex(0),
                                           ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))


def test_lost_gpu_answers_gpu_is_lost(nodes: dict[str, SimulatedNode]) -> None:
    node = nodes["dgx-h100"]
    handle = node.nvml.nvmlDeviceGetHandleByIndex(3)
    node.inject_xid(node.gpu_uuids()[3], 79)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        node.nvml.nvmlDeviceGetNvLinkState(handle, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        node.nvml.nvmlDeviceGetTopologyCommonAncestor(
            node.nvml.nvmlDeviceGetHandleByIndex(0), handle)


def test_sysfs_links_point_into_a_root_complex(nodes: dict[str, SimulatedNode]) -> None:
    node = nodes["a100-pcie-bridged"]
    link = node.sys_root / "bus" / "pci" / "devices" / "0000:17:00.0"
    assert link.is_symlink() and "pci0000:13" in str(link.resolve())
