"""The guard the read-only device check installs: every NVML function that could change a
shared GPU is refused, every read the agent makes passes."""

from __future__ import annotations

import types

import pynvml
import pytest

from tests.device import readonly_nvml

MUTATIONS = [
    "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceDestroy", "nvmlComputeInstanceDestroy", "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceClearEccErrorCounts", "nvmlDeviceSetComputeMode", "nvmlDeviceModifyDrainState",
    "nvmlDeviceRemoveGpu",
]
READS = [
    "nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetMigMode",
    "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlDeviceGetFieldValues",
    "nvmlEventSetCreate", "nvmlEventSetWait_v2", "nvmlEventSetFree",
    "nvmlDeviceRegisterEvents", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
    "nvmlDeviceGetNvLinkState", "nvmlSystemGetDriverVersion",
]


def _copy_of_pynvml() -> types.SimpleNamespace:
    """pynvml's functions and constants in a namespace of their own (the real module stays
    untouched for the other tests); calling one here would reach no driver."""
    return types.SimpleNamespace(**vars(pynvml))


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutations_are_refused_and_recorded(name: str) -> None:
    nvml = _copy_of_pynvml()
    wrapped = readonly_nvml.install(nvml)
    assert name in wrapped
    readonly_nvml.blocked.clear()
    with pytest.raises(pynvml.NVMLError) as refused:
        getattr(nvml, name)(object())
    assert refused.value.value == pynvml.NVML_ERROR_NO_PERMISSION
    assert readonly_nvml.blocked == [name]


def test_reads_pass_through() -> None:
    nvml = _copy_of_pynvml()
    wrapped = set(readonly_nvml.install(nvml))
    assert not wrapped & set(READS)
    for name in READS:
        assert getattr(nvml, name) is getattr(pynvml, name)
