"""The simulator passes for the pynvml module: init reference counting, constants and
struct classes from pynvml, FUNCTION_NOT_FOUND for the rest, and the process controls."""

from __future__ import annotations

import ctypes
import threading

import pynvml
import pytest

from agent.errors import Conflict, InvalidRequest, NotFound
from agent.gpu.sim.node import SimulatedNode

from .conftest import NodeFactory, create_gi, enable_mig


def test_init_and_shutdown_are_reference_counted(h100: SimulatedNode) -> None:
    """Two inits need two shutdowns; a shutdown too many is UNINITIALIZED."""
    nvml = h100.nvml
    nvml.nvmlInitWithFlags(0)
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 8
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetFanSpeed(None)
    nvml.nvmlInit()


def test_module_attributes_come_from_pynvml(h100: SimulatedNode) -> None:
    """Constants, struct classes, error classes and pure helpers are pynvml's own."""
    nvml = h100.nvml
    assert nvml.NVML_ERROR_IN_USE == pynvml.NVML_ERROR_IN_USE
    assert nvml.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_InUse is pynvml.NVMLError_InUse
    assert nvml.nvmlStructToFriendlyObject is pynvml.nvmlStructToFriendlyObject
    with pytest.raises(AttributeError):
        _ = nvml.no_such_thing


def test_system_versions(h100: SimulatedNode) -> None:
    """Driver 570.133.20, CUDA 12.8, NVML 12.570.133.20, as str/int like pynvml returns."""
    nvml = h100.nvml
    assert nvml.nvmlSystemGetDriverVersion() == "570.133.20"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 12080
    assert nvml.nvmlSystemGetCudaDriverVersion_v2() == 12080
    assert nvml.nvmlSystemGetNVMLVersion() == "12.570.133.20"


def test_handle_lookups(h100: SimulatedNode) -> None:
    """Handles by index, UUID and PCI bus id (any common spelling) name the same GPU."""
    nvml = h100.nvml
    uuid = h100.gpu_uuids()[4]
    assert uuid.startswith("GPU-")
    for handle in (nvml.nvmlDeviceGetHandleByIndex(4), nvml.nvmlDeviceGetHandleByUUID(uuid),
                   nvml.nvmlDeviceGetHandleByPciBusId("00000000:9D:00.0"),
                   nvml.nvmlDeviceGetHandleByPciBusId(b"0000:9d:00.0")):
        assert nvml.nvmlDeviceGetUUID(handle) == uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByPciBusId("0000:01:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(8)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-nope")


def test_memory_info_versions(h100: SimulatedNode) -> None:
    """Memory v1 counts reserved memory as used; v2 reports it separately."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert v1.total == v2.total == 81559 * 2**20
    assert v2.reserved > 0
    assert v2.free + v2.reserved + v2.used == v2.total


def test_mig_device_handles_refuse_whole_gpu_calls(h100: SimulatedNode) -> None:
    """MIG handles answer NOT_SUPPORTED for telemetry, index and minor; GPU handles answer
    NOT_SUPPORTED for GetAttributes and INVALID_ARGUMENT for MIG-only ids."""
    nvml = h100.nvml
    handle = enable_mig(h100)
    nvml.nvmlGpuInstanceCreateComputeInstance(create_gi(h100, handle, 0), 4)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    for call in (lambda: nvml.nvmlDeviceGetPowerUsage(mig),
                 lambda: nvml.nvmlDeviceGetIndex(mig),
                 lambda: nvml.nvmlDeviceGetMinorNumber(mig),
                 lambda: nvml.nvmlDeviceGetMigMode(mig),
                 lambda: nvml.nvmlDeviceGetAttributes(handle)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    for call in (lambda: nvml.nvmlDeviceGetGpuInstanceId(handle),
                 lambda: nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle),
                 lambda: nvml.nvmlDeviceCreateGpuInstance(mig, 19)):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call()
    assert nvml.nvmlDeviceGetPciInfo(mig).busId == "00000000:1B:00.0"


def test_add_process_rules(h100: SimulatedNode) -> None:
    """Processes get pids from 100000 up, default 1 GiB, must fit, must be unique, and run on
    a MIG device (not the parent) once MIG is on."""
    gpus = h100.gpu_uuids()
    first = h100.add_process(gpus[0])
    second = h100.add_process(gpus[0])
    assert (first["pid"], second["pid"], first["used_memory_mib"]) == (100000, 100001, 1024)
    with pytest.raises(InvalidRequest):
        h100.add_process(gpus[0], pid=100000)
    with pytest.raises(InvalidRequest):
        h100.add_process(gpus[1], used_memory_mib=81559)
    with pytest.raises(NotFound):
        h100.add_process("GPU-nope")
    with pytest.raises(NotFound):
        h100.remove_process(7)
    handle = enable_mig(h100, 2)
    with pytest.raises(InvalidRequest):
        h100.add_process(gpus[2])
    gi = create_gi(h100, handle, 19)
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig_uuid = h100.nvml.nvmlDeviceGetUUID(h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    with pytest.raises(InvalidRequest):
        h100.add_process(mig_uuid, used_memory_mib=9984)
    placed = h100.add_process(mig_uuid, used_memory_mib=4096)
    assert (placed["gpu_uuid"], placed["gpu_instance_id"], placed["compute_instance_id"]) == (
        gpus[2], 13, 0)
    h100.inject_xid(gpus[3], 79)
    with pytest.raises(Conflict):
        h100.add_process(gpus[3])


def test_describe(make_node: NodeFactory) -> None:
    """describe() reports preset, all presets, processes, faults, latencies and calls."""
    node = make_node("l40s")
    node.add_process(node.gpu_uuids()[1], pid=55)
    described = node.describe()
    assert described["preset"] == "l40s"
    assert "dgx-h100" in described["presets"]
    assert [p["pid"] for p in described["processes"]] == [55]
    assert described["calls"] == {"nvmlInit": 1, "nvmlInitWithFlags": 1}
    assert described["gpus"][1]["mig_mode"] is None
    assert {"faults", "latencies"} <= described.keys()


def test_concurrent_calls_are_safe(h100: SimulatedNode) -> None:
    """Threads creating and destroying instances on different GPUs never corrupt the state."""
    handles = [enable_mig(h100, i) for i in range(4)]
    errors: list[BaseException] = []

    def churn(handle: object) -> None:
        try:
            for _ in range(20):
                gis = [h100.nvml.nvmlDeviceCreateGpuInstance(handle, 19) for _ in range(7)]
                for gi in gis:
                    h100.nvml.nvmlGpuInstanceDestroy(gi)
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=churn, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    count = ctypes.c_uint(0)
    h100.nvml.nvmlDeviceGetGpuInstances(handles[0], 19, None, ctypes.byref(count))
    assert count.value == 0
