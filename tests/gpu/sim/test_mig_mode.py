"""MIG mode as on hardware: NOT_SUPPORTED while off or on a GPU without MIG, Hopper switches
at once, Ampere waits for a reset, busy GPUs stay pending, driver reloads differ by arch."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pynvml
import pytest

from agent.errors import Conflict
from agent.gpu.sim.node import SimulatedNode

from .conftest import NodeFactory, create_gi, enable_mig

ENABLE, DISABLE = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE


def test_mig_calls_are_not_supported_while_mig_is_off(h100: SimulatedNode) -> None:
    """Capacity, create and enumeration calls answer NOT_SUPPORTED with MIG disabled;
    MaxMigDeviceCount is 0, while profile info and possible placements are still listed
    (nvml.h: placements "regardless of whether MIG is enabled", which needs the profile id)."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(handle) == [DISABLE, DISABLE]
    calls: list[Callable[[], object]] = [
        lambda: nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 19),
        lambda: nvml.nvmlDeviceCreateGpuInstance(handle, 19),
        lambda: nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, 19, pynvml.c_nvmlGpuInstancePlacement_t(0, 1)),
        lambda: nvml.nvmlDeviceGetGpuInstances(handle, 19, None, ctypes.byref(ctypes.c_uint())),
        lambda: nvml.nvmlDeviceGetGpuInstanceById(handle, 7),
        lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, 0).id == 19
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfoById(handle, 9).sliceCount == 3
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 9, None, ctypes.byref(count))
    assert count.value == 2


def test_l40s_has_no_mig(make_node: NodeFactory) -> None:
    """On L40S GetMigMode/SetMigMode and profile calls are NOT_SUPPORTED; no MIG devices."""
    nvml = make_node("l40s").nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    for call in (lambda: nvml.nvmlDeviceGetMigMode(handle),
                 lambda: nvml.nvmlDeviceSetMigMode(handle, ENABLE),
                 lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, 0),
                 lambda: nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                     handle, 19, None, ctypes.byref(ctypes.c_uint()))):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    assert not nvml.nvmlDeviceGetSupportedEventTypes(handle) & pynvml.nvmlEventMigConfigChange


def test_hopper_enables_mig_at_once(h100: SimulatedNode) -> None:
    """On H100 SetMigMode takes effect immediately with activation status SUCCESS."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    assert nvml.nvmlDeviceSetMigMode(handle, ENABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(handle) == [ENABLE, ENABLE]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 7
    assert nvml.nvmlDeviceSetMigMode(handle, DISABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(handle) == [DISABLE, DISABLE]


def test_ampere_mode_stays_pending_until_reset(a100: SimulatedNode) -> None:
    """On A100 an enable is pending (current off) until reset_gpu applies it."""
    nvml = a100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(handle, ENABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(handle) == [DISABLE, ENABLE]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstance(handle, 19)
    a100.reset_gpu(nvml.nvmlDeviceGetUUID(handle))
    assert nvml.nvmlDeviceGetMigMode(handle) == [ENABLE, ENABLE]
    create_gi(a100, handle, 19)


def test_busy_gpu_leaves_the_mode_pending_with_in_use(h100: SimulatedNode) -> None:
    """With a process on the GPU, SetMigMode returns activation IN_USE and stays pending;
    resetting (once the process is gone) applies it."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    process = h100.add_process(uuid)
    assert nvml.nvmlDeviceSetMigMode(handle, ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(handle) == [DISABLE, ENABLE]
    with pytest.raises(Conflict):
        h100.reset_gpu(uuid)
    h100.remove_process(process["pid"])
    h100.reset_gpu(uuid)
    assert nvml.nvmlDeviceGetMigMode(handle) == [ENABLE, ENABLE]


def test_disabling_with_gpu_instances_is_in_use(h100: SimulatedNode) -> None:
    """SetMigMode(DISABLE) with GPU instances present raises IN_USE and changes nothing."""
    handle = enable_mig(h100)
    create_gi(h100, handle, 0)
    with pytest.raises(pynvml.NVMLError_InUse):
        h100.nvml.nvmlDeviceSetMigMode(handle, DISABLE)
    assert h100.nvml.nvmlDeviceGetMigMode(handle) == [ENABLE, ENABLE]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvml.nvmlDeviceSetMigMode(handle, 2)


def test_reload_driver_hopper_forgets_mode_and_instances(h100: SimulatedNode) -> None:
    """A driver reload on Hopper disables MIG and drops instances; the energy counter starts
    again from zero (NVML counts it since the driver loaded); the kernel's boot id stays, as
    on a real node (issue 24: it used to change)."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 9)
    boot = h100.boot_id
    h100.hardware.state.gpus[0].energy_mj = 10**9
    before = h100.nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    h100.reload_driver()
    assert h100.nvml.nvmlDeviceGetMigMode(handle) == [DISABLE, DISABLE]
    assert h100.nvml.nvmlDeviceGetTotalEnergyConsumption(handle) < before
    assert h100.boot_id == boot
    assert (h100.proc_root / "sys/kernel/random/boot_id").read_text() == f"{boot}\n"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvml.nvmlGpuInstanceGetInfo(gi)
    h100.reboot()  # only a reboot changes the boot id
    assert h100.boot_id != boot
    assert (h100.proc_root / "sys/kernel/random/boot_id").read_text() == f"{h100.boot_id}\n"


def test_reload_driver_ampere_keeps_mode_and_applies_pending(a100: SimulatedNode) -> None:
    """Ampere keeps MIG mode across a reload (InfoROM), applies a pending one, loses GIs."""
    nvml = a100.nvml
    enabled = enable_mig(a100, 0)
    create_gi(a100, enabled, 0)
    pending = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceSetMigMode(pending, ENABLE)
    a100.reload_driver()
    assert nvml.nvmlDeviceGetMigMode(enabled) == [ENABLE, ENABLE]
    assert nvml.nvmlDeviceGetMigMode(pending) == [ENABLE, ENABLE]
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(enabled, 0) == 1


def test_reload_driver_refuses_running_processes(h100: SimulatedNode) -> None:
    """Processes block a driver reload (Conflict) unless it is a reboot that kills them."""
    h100.add_process(h100.gpu_uuids()[0])
    with pytest.raises(Conflict):
        h100.reload_driver()
    h100.reload_driver(kill_processes=True)
    assert h100.describe()["processes"] == []
