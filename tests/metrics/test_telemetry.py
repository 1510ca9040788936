"""The NVML layer of the collector: what it reads from the simulator on each model, and,
through a fake with fixed answers (field values, encoder/decoder, GPM), the DCGM mapping,
rates, unsupported-field caching and GPM sample lifetimes."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.gpu import telemetry
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.telemetry import GpuTelemetry
from agent.metrics.fields import BY_NAME
from tests.metrics.conftest import Sim

NVLINK = {pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
          pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX}
# KiB each NVLink counter grows by per read, in the fake.
NVLINK_STEP_KIB = 250_000


class RichNvml:
    """The simulated NVML with fixed answers for field values, encoder/decoder and GPM, so
    the DCGM mapping, units and sample lifetimes can be checked exactly."""

    def __init__(self, sim: Any) -> None:
        self._sim = sim
        self.field_requests: list[list[Any]] = []
        self.nvlink_kib = 0
        self.samples: list[Any] = []
        self.freed: list[int] = []
        self.metric_pairs: list[tuple[int, int]] = []
        self.mig_samples: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)

    def nvmlDeviceGetFieldValues(self, handle: Any, ids: list[Any]) -> Any:
        self._sim.nvmlDeviceGetUUID(handle)  # a lost GPU answers GPU_IS_LOST here too
        self.field_requests.append(list(ids))
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for i, requested in enumerate(ids):
            fid, scope = requested if isinstance(requested, tuple) else (requested, 0)
            value = values[i]
            value.fieldId, value.scopeId = fid, scope
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                # r545 reports a double type for this integer field.
                value.valueType = pynvml.NVML_VALUE_TYPE_DOUBLE
                value.value.uiVal = 45
            elif fid in NVLINK:
                self.nvlink_kib += NVLINK_STEP_KIB
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = self.nvlink_kib
            elif fid == pynvml.NVML_FI_DEV_RETIRED_PENDING:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif fid == pynvml.NVML_FI_DEV_PERF_POLICY_POWER:
                value.valueType = pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG
                value.value.sllVal = 123_456_789
            else:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = fid % 7
        return values

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        self._sim.nvmlDeviceGetUUID(handle)
        return [7, 167_000]

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        self._sim.nvmlDeviceGetUUID(handle)
        return [3, 167_000]

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        self._sim.nvmlDeviceGetUUID(handle)
        support = pynvml.c_nvmlGpmSupport_t()
        support.isSupportedDevice = 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        cell = ctypes.c_int(len(self.samples))
        self.samples.append(cell)
        return ctypes.cast(ctypes.pointer(cell), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        self._sim.nvmlDeviceGetUUID(handle)
        return sample

    def nvmlGpmMigSampleGet(self, handle: Any, gi_id: int, sample: Any) -> Any:
        self.mig_samples.append(int(gi_id))
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.freed.append(_sample_id(sample))

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self.metric_pairs.append((_sample_id(request.sample1), _sample_id(request.sample2)))
        for i in range(int(request.numMetrics)):
            metric = request.metrics[i]
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = 40.0 + int(metric.metricId)
        return request


def _sample_id(sample: Any) -> int:
    return int(ctypes.cast(sample, ctypes.POINTER(ctypes.c_int)).contents.value)


def reader(sim: Sim, index: int = 0, nvml: Any = None) -> GpuTelemetry:
    gpu = sim.inventory.gpus[index]
    session = sim.session if nvml is None else NvmlSession(nvml)
    return GpuTelemetry(session, gpu.static, gpu.profiles)


async def test_simulator_fields_follow_its_telemetry(sim: Sim) -> None:
    """What the simulator models is read with DCGM's units; GPM needs two samples, so the
    profiling fields come from the second round on, never as a made-up first value."""
    uuid = sim.node.gpu_uuids()[2]
    sim.node.add_process(uuid, pid=4242, used_memory_mib=4096)
    gpu = reader(sim, 2)
    values = dict(gpu.read().values)
    assert 0 < values["DCGM_FI_DEV_GPU_UTIL"] <= 100
    assert values["DCGM_FI_DEV_FB_USED"] == 4096 + 5  # the process and the driver's contexts
    assert values["DCGM_FI_DEV_FB_FREE"] + values["DCGM_FI_DEV_FB_USED"] + \
        values["DCGM_FI_DEV_FB_RESERVED"] == sim.inventory.gpus[2].static.memory_total_mib
    assert isinstance(values["DCGM_FI_DEV_POWER_USAGE"], float)  # mW / 1000
    assert values["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] > 0
    assert values["DCGM_FI_DEV_MEMORY_TEMP"] > values["DCGM_FI_DEV_GPU_TEMP"]
    assert set(values) <= set(BY_NAME)
    assert not any(name.startswith("DCGM_FI_PROF_") for name in values)
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in values  # a rate: two readings
    second = dict(gpu.read().values)
    assert 0 < second["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] <= 1
    assert second["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] > 0
    gpu.close()


# preset -> (fields every whole GPU has from the second round, fields it never has)
MODELS = {
    "hgx-h200": ({"DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                  "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_ENC_UTIL"},
                 {"DCGM_FI_DEV_RETIRED_DBE"}),
    "dgx-a100": ({"DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                  "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"},
                 {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_RETIRED_DBE"}),
    "l40s": ({"DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
              "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_VGPU_LICENSE_STATUS"},
             {"DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
              "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
              "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"}),
}


@pytest.mark.parametrize(("preset", "present", "absent"),
                         [(k, *v) for k, v in MODELS.items()], ids=list(MODELS))
async def test_each_model_serves_what_its_hardware_reports(
        tmp_path: Path, preset: str, present: set[str], absent: set[str]) -> None:
    """What a model lacks answers NOT_SUPPORTED in the simulator and has no value here (GPM
    before Hopper, memory temperature off HBM, NVLink without links, page retirement on
    boards that remap rows); the rest is there."""
    node = SimulatedNode(preset, tmp_path / "state", tmp_path / "proc")
    session = NvmlSession(node.nvml)
    try:
        await session.initialise()
        inventory = GpuInventory(session)
        await inventory.load()
        gpu = inventory.gpus[0]
        telemetry_ = GpuTelemetry(session, gpu.static, gpu.profiles)
        telemetry_.read()
        values = dict(telemetry_.read().values)
        assert present <= set(values)
        assert not absent & set(values)
        telemetry_.close()
    finally:
        session.close()
        node.close()


async def test_unsupported_fields_are_asked_once(sim: Sim) -> None:
    """NOT_SUPPORTED is remembered: one call, one counted error; other fields go on."""
    sim.node.add_fault("nvmlDeviceGetPcieReplayCounter", "NVML_ERROR_NOT_SUPPORTED",
                       times=100)
    gpu = reader(sim, 1)
    before = sim.calls()
    for _ in range(3):
        gpu.read()
    after = sim.calls()
    assert after["nvmlDeviceGetPcieReplayCounter"] - before.get(
        "nvmlDeviceGetPcieReplayCounter", 0) == 1
    assert after["nvmlDeviceGetPowerUsage"] - before.get("nvmlDeviceGetPowerUsage", 0) == 3
    assert sim.metrics.registry.get_sample_value("gpu_agent_nvml_errors_total", {
        "function": "nvmlDeviceGetPcieReplayCounter", "code": "NVML_ERROR_NOT_SUPPORTED"}) == 1


async def test_field_values_gpm_and_rates_map_to_dcgm(sim: Sim,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Field-value rows, MEMORY_TEMP as uiVal, the NVLink rate (KiB/s / 1000 as DCGM), GPM
    ratios (percent / 100) and PCIe bytes (MiB/s * 2^20), none on the first round."""
    now = [1000.0]
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(monotonic=lambda: now[0]))
    nvml = RichNvml(sim.node.nvml)
    gpu = reader(sim, 0, nvml)
    first = dict(gpu.read().values)
    assert first["DCGM_FI_DEV_MEMORY_TEMP"] == 45
    assert first["DCGM_FI_DEV_ENC_UTIL"] == 7 and first["DCGM_FI_DEV_DEC_UTIL"] == 3
    assert first["DCGM_FI_DEV_POWER_VIOLATION"] == 123_456_789
    assert first["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == pynvml.NVML_FI_DEV_REMAPPED_FAILURE % 7
    assert "DCGM_FI_DEV_RETIRED_PENDING" not in first
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in first
    assert not any(name.startswith("DCGM_FI_PROF_") for name in first)
    now[0] += 5.0
    second = dict(gpu.read().values)
    assert second["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == pytest.approx(
        2 * NVLINK_STEP_KIB * 2 / 5.0 / 1000)
    assert second["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(
        (40 + pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL) / 100)
    assert second["DCGM_FI_PROF_PCIE_TX_BYTES"] == pytest.approx(
        (40 + pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC) * 2**20)
    # A field whose own status said NOT_SUPPORTED is no longer requested.
    assert pynvml.NVML_FI_DEV_RETIRED_PENDING in nvml.field_requests[0]
    assert pynvml.NVML_FI_DEV_RETIRED_PENDING not in nvml.field_requests[1]
    # GPM: metrics over (previous, current); the previous sample is freed, the current kept.
    assert nvml.metric_pairs == [(0, 1)]
    assert nvml.freed == [0]
    gpu.close()
    assert nvml.freed == [0, 1]


class MigGpmOnly(RichNvml):
    """A driver that refuses whole-GPU GPM samples in MIG mode (per-instance ones work)."""

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


async def test_mig_instances_are_read_per_gpu_instance(sim: Sim) -> None:
    """Each GPU instance: its own framebuffer and GPM (nvmlGpmMigSampleGet with its GI id),
    even where the whole-GPU sample is refused; the whole GPU loses utilisation (NVML has
    none in MIG mode) but keeps power."""
    await sim.split(0, (0, 1, 2))
    nvml = MigGpmOnly(sim.node.nvml)
    gpu = reader(sim, 0, nvml)
    gpu.read()
    reading = gpu.read()
    assert reading.mig_mode
    assert "DCGM_FI_DEV_GPU_UTIL" not in reading.values
    assert "DCGM_FI_DEV_POWER_USAGE" in reading.values
    assert [m.profile for m in reading.mig] == ["1g.10gb"] * 3
    gi_ids = [m.gi_id for m in reading.mig]
    assert len(set(gi_ids)) == 3
    for mig in reading.mig:
        assert mig.values["DCGM_FI_DEV_FB_USED"] == 13
        assert mig.device is not None
        assert mig.values["DCGM_FI_DEV_FB_FREE"] + 13 == mig.device.memory_mib
        assert "DCGM_FI_PROF_DRAM_ACTIVE" in mig.values
    assert sorted(set(nvml.mig_samples)) == sorted(gi_ids)


async def test_utilisation_returns_when_mig_is_turned_off(sim: Sim) -> None:
    """Support changes with the MIG mode, so the unsupported memory is cleared then."""
    await sim.split(3, (0,))
    gpu = reader(sim, 3)
    assert "DCGM_FI_DEV_GPU_UTIL" not in gpu.read().values

    def disable() -> None:
        from agent.gpu import mig  # noqa: PLC0415

        handle = sim.session.call("nvmlDeviceGetHandleByIndex", 3)
        uuid = sim.node.gpu_uuids()[3]
        gi_id = sim.inventory.gpus[3].mig_devices[0].gi_id
        mig.destroy_compute_instances(sim.session, handle, uuid, gi_id)
        mig.destroy_gpu_instance(sim.session, handle, uuid, gi_id)
        mig.set_mig_mode(sim.session, handle, uuid, False)

    await sim.session.read(disable)
    reading = gpu.read()
    assert not reading.mig_mode and reading.mig == ()
    assert "DCGM_FI_DEV_GPU_UTIL" in reading.values


async def test_a_lost_gpu_reads_as_lost(sim: Sim) -> None:
    sim.node.inject_xid(sim.node.gpu_uuids()[5], 79)
    reading = reader(sim, 5).read()
    assert reading.lost and reading.values == {}
    assert "GPU_IS_LOST" in (reading.error or "")


class MemoryV1Only(RichNvml):
    """A driver older than 510: no nvmlDeviceGetMemoryInfo_v2."""

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        if version is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._sim.nvmlDeviceGetMemoryInfo(handle)


async def test_old_drivers_get_framebuffer_without_reserved(sim: Sim) -> None:
    gpu = reader(sim, 0, MemoryV1Only(sim.node.nvml))
    for _ in range(2):
        values = gpu.read().values
        assert values["DCGM_FI_DEV_FB_USED"] == 5 and "DCGM_FI_DEV_FB_RESERVED" not in values
