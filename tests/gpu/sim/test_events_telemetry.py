"""XID events reach event sets (and XID 79 loses the GPU); telemetry follows the load."""

from __future__ import annotations

import threading
import time
from typing import Any

import pynvml
import pytest

from agent.gpu.sim.hardware import NO_INSTANCE
from agent.gpu.sim.node import SimulatedNode
from tests.waiting import wait_for

from .conftest import create_gi, enable_mig


def _xid_set(node: SimulatedNode, index: int) -> Any:
    event_set = node.nvml.nvmlEventSetCreate()
    handle = node.nvml.nvmlDeviceGetHandleByIndex(index)
    node.nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    return event_set


def test_injected_xid_wakes_a_waiting_event_set(h100: SimulatedNode) -> None:
    """A thread blocked in nvmlEventSetWait_v2 gets the XID injected meanwhile."""
    event_set = _xid_set(h100, 2)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(
        h100.nvml.nvmlEventSetWait_v2(event_set, 5000)))
    waiter.start()
    wait_for(lambda: h100.hardware.event_waiters == 1, "the thread to block in the wait")
    h100.inject_xid(h100.gpu_uuids()[2], 48)
    waiter.join(timeout=5)
    assert len(got) == 1
    data = got[0]
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 48)
    assert (data.gpuInstanceId, data.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)
    assert h100.nvml.nvmlDeviceGetUUID(data.device) == h100.gpu_uuids()[2]


def test_wait_without_events_times_out(h100: SimulatedNode) -> None:
    """No event within the timeout raises NVMLError_Timeout; other GPUs' XIDs don't count."""
    event_set = _xid_set(h100, 0)
    h100.inject_xid(h100.gpu_uuids()[1], 13)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        h100.nvml.nvmlEventSetWait(event_set, 50)
    assert time.monotonic() - started >= 0.05
    h100.nvml.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvml.nvmlEventSetWait_v2(event_set, 0)


def test_xid_on_a_mig_device_names_its_instances(h100: SimulatedNode) -> None:
    """An XID on a MIG device carries its GI/CI ids and the parent GPU's handle."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 9, (4, 4))
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    event_set = _xid_set(h100, 0)
    mig_uuid = h100.nvml.nvmlDeviceGetUUID(h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    h100.inject_xid(mig_uuid, 43)
    data = h100.nvml.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (43, 2, 0)


def test_mig_changes_raise_mig_config_events(h100: SimulatedNode) -> None:
    """Sets registered for nvmlEventMigConfigChange see GI/CI creation."""
    handle = enable_mig(h100)
    event_set = h100.nvml.nvmlEventSetCreate()
    h100.nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventMigConfigChange, event_set)
    create_gi(h100, handle, 0)
    assert h100.nvml.nvmlEventSetWait_v2(event_set, 0).eventType == pynvml.nvmlEventMigConfigChange


def test_unsupported_event_types_are_refused(h100: SimulatedNode) -> None:
    """Registering an event type the GPU does not support is NOT_SUPPORTED."""
    handle = h100.nvml.nvmlDeviceGetHandleByIndex(0)
    supported = h100.nvml.nvmlDeviceGetSupportedEventTypes(handle)
    assert supported & pynvml.nvmlEventTypeXidCriticalError
    with pytest.raises(pynvml.NVMLError_NotSupported):
        h100.nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypePowerSourceChange,
                                           h100.nvml.nvmlEventSetCreate())


def test_xid_79_loses_the_gpu_and_its_instances(h100: SimulatedNode) -> None:
    """After XID 79 every call with the GPU's handles (GPU, GI, MIG) is GPU_IS_LOST, other
    GPUs are fine, and reset_gpu brings it back."""
    nvml = h100.nvml
    handle = enable_mig(h100, 4)
    gi = create_gi(h100, handle, 0)
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, 4)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    uuid = h100.gpu_uuids()[4]
    assert h100.inject_xid(uuid, 79)["lost"]
    for call in (lambda: nvml.nvmlDeviceGetUUID(handle), lambda: nvml.nvmlDeviceGetUUID(mig),
                 lambda: nvml.nvmlGpuInstanceGetInfo(gi),
                 lambda: nvml.nvmlDeviceGetHandleByUUID(uuid),
                 lambda: nvml.nvmlDeviceGetPowerUsage(handle)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3))
    h100.reset_gpu(uuid)
    assert nvml.nvmlDeviceGetUUID(handle) == uuid
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceGetInfo(gi)  # the reset destroyed it


def test_telemetry_rises_with_a_process(h100: SimulatedNode) -> None:
    """Idle H100: 0 % util, ~70 W, idle clock; with a process util, power, temperature,
    SM clock and used memory all go up, within the 700 W limit."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    idle_util = nvml.nvmlDeviceGetUtilizationRates(handle)
    idle_power = nvml.nvmlDeviceGetPowerUsage(handle)
    idle_temp = nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    idle_clock = nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    idle_used = nvml.nvmlDeviceGetMemoryInfo(handle).used
    assert (idle_util.gpu, idle_util.memory, idle_power) == (0, 0, 70_000)
    h100.add_process(h100.gpu_uuids()[0], used_memory_mib=30000)
    util = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert util.gpu > 50 and util.memory > 0
    assert idle_power < nvml.nvmlDeviceGetPowerUsage(handle) <= 700_000
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
    assert nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) > idle_temp
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) > idle_clock
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM) == 2619
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    assert memory.used - idle_used == 30000 * 1024 * 1024
    assert memory.free == memory.total - memory.used


def test_energy_counter_is_monotonic(h100: SimulatedNode) -> None:
    """The energy counter never decreases across load changes and grows faster under load."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    readings = [nvml.nvmlDeviceGetTotalEnergyConsumption(handle)]
    process = h100.add_process(h100.gpu_uuids()[0])

    def grown() -> int | None:
        now: int = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return now if now > readings[-1] else None

    for _ in range(3):  # the counter integrates power over time
        readings.append(wait_for(grown, "the energy counter to grow under load", every_s=0.005))
    h100.remove_process(process["pid"])
    readings.append(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    assert readings == sorted(readings)
    assert readings[-2] > readings[0]


def test_processes_are_listed_per_gpu_and_per_mig_device(h100: SimulatedNode) -> None:
    """A MIG GPU's handle lists all its MIG processes with GI/CI ids; a MIG handle only its
    own; a whole-GPU process has no instance ids."""
    nvml = h100.nvml
    handle = enable_mig(h100)
    for start in (0, 4):
        gi = create_gi(h100, handle, 9, (start, 4))
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    migs = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i) for i in (0, 1)]
    h100.add_process(nvml.nvmlDeviceGetUUID(migs[0]), pid=10, used_memory_mib=100)
    h100.add_process(nvml.nvmlDeviceGetUUID(migs[1]), pid=11, used_memory_mib=200)
    listed = sorted((p.pid, p.usedGpuMemory // 2**20, p.gpuInstanceId, p.computeInstanceId)
                    for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    assert listed == [(10, 100, 1, 0), (11, 200, 2, 0)]
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses_v2(migs[1])] == [11]
    other = nvml.nvmlDeviceGetHandleByIndex(1)
    h100.add_process(h100.gpu_uuids()[1], pid=12)
    (whole,) = nvml.nvmlDeviceGetComputeRunningProcesses(other)
    assert (whole.pid, whole.gpuInstanceId, whole.computeInstanceId) == (
        12, NO_INSTANCE, NO_INSTANCE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(handle)  # no utilisation in MIG mode
    assert nvml.nvmlDeviceGetPowerUsage(handle) > 70_000
