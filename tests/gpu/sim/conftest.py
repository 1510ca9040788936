"""Fixtures for the simulated node: a node per test in its own temporary state directory."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu.sim.node import SimulatedNode

NodeFactory = Callable[[str], SimulatedNode]


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[NodeFactory]:
    """Open simulated nodes (NVML initialised) under tmp_path; all are closed afterwards."""
    opened: list[SimulatedNode] = []

    def make(preset: str) -> SimulatedNode:
        node = SimulatedNode(preset, tmp_path / f"state-{len(opened)}",
                             tmp_path / f"proc-{len(opened)}")
        node.nvml.nvmlInit()
        opened.append(node)
        return node

    yield make
    for node in opened:
        node.close()


@pytest.fixture
def h100(make_node: NodeFactory) -> SimulatedNode:
    return make_node("dgx-h100")


@pytest.fixture
def a100(make_node: NodeFactory) -> SimulatedNode:
    return make_node("dgx-a100")


def enable_mig(node: SimulatedNode, index: int = 0) -> Any:
    """Enable MIG on one GPU (resetting an Ampere GPU so it takes effect); its handle."""
    nvml = node.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    if nvml.nvmlDeviceGetMigMode(handle)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
        node.reset_gpu(nvml.nvmlDeviceGetUUID(handle))
    return handle


def placement(start: int, size: int) -> Any:
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def create_gi(node: SimulatedNode, handle: Any, profile_id: int,
              at: tuple[int, int] | None = None) -> Any:
    if at is None:
        return node.nvml.nvmlDeviceCreateGpuInstance(handle, profile_id)
    return node.nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, profile_id, ctypes.byref(placement(*at)))


def nvml_code(excinfo: pytest.ExceptionInfo[Any]) -> int:
    return int(excinfo.value.value)


def gi_placements(node: SimulatedNode, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """(start, size) of the GPU instances of one profile, via nvmlDeviceGetGpuInstances."""
    array = (pynvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(8)
    node.nvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    found = []
    for gi in array[: count.value]:
        info = node.nvml.nvmlGpuInstanceGetInfo(gi)
        found.append((info.placement.start, info.placement.size))
    return sorted(found)
