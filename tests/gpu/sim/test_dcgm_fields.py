"""The calls behind dcgm-exporter's default fields answer as a real driver does on each model:
GPM on Hopper only (per GPU, per GPU instance in MIG mode, the mean of the load between two
samples), field values with their own status (memory temperature on HBM only, NVLink
counters where links are wired), encoder/decoder, PCIe replays, row remapping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.gpu.sim import hardware
from agent.gpu.sim.node import SimulatedNode

from .conftest import NodeFactory, create_gi, enable_mig, nvml_code

GRAPHICS = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
PCIE_RX = pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
ALL_LINKS = 0xFFFFFFFF


class Clock:
    """A hand-moved clock for the simulator's activity counters."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(hardware, "time", SimpleNamespace(monotonic=fake.monotonic,
                                                          time=fake.time))
    return fake


def sample(node: SimulatedNode, handle: Any, gi_id: int | None = None) -> Any:
    taken = node.nvml.nvmlGpmSampleAlloc()
    if gi_id is None:
        node.nvml.nvmlGpmSampleGet(handle, taken)
    else:
        node.nvml.nvmlGpmMigSampleGet(handle, gi_id, taken)
    return taken


def metrics(node: SimulatedNode, first: Any, second: Any, *ids: int) -> list[tuple[int, float]]:
    """(nvmlReturn, value) of each metric between two samples."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1, request.sample2 = first, second
    for i, metric in enumerate(ids):
        request.metrics[i].metricId = metric
    result = node.nvml.nvmlGpmMetricsGet(request)
    return [(int(result.metrics[i].nvmlReturn), float(result.metrics[i].value))
            for i in range(len(ids))]


def fields(node: SimulatedNode, index: int, *ids: Any) -> list[tuple[int, int]]:
    """(nvmlReturn, value) of each requested field of a GPU."""
    handle = node.nvml.nvmlDeviceGetHandleByIndex(index)
    found = node.nvml.nvmlDeviceGetFieldValues(handle, list(ids))
    return [(int(v.nvmlReturn), int(v.value.ullVal if v.valueType ==
                                    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                                    else v.value.uiVal)) for v in found]


def test_gpm_is_the_mean_of_the_load_between_two_samples(make_node: NodeFactory,
                                                          clock: Clock) -> None:
    """Idle for 10 s, then a 64 % process for 10 s: graphics activity reads 32 % over the
    20 s, 64 % over the next 10 s; PCIe RX follows the same load in MiB/s."""
    node = make_node("hgx-h200")
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    first = sample(node, handle)
    clock.now += 10
    node.add_process(node.gpu_uuids()[0], pid=300)  # 64 % (agent/gpu/sim/telemetry.py)
    clock.now += 10
    second = sample(node, handle)
    clock.now += 10
    third = sample(node, handle)
    (ok, half), (_, rx) = metrics(node, first, second, GRAPHICS, PCIE_RX)
    assert ok == pynvml.NVML_SUCCESS and half == pytest.approx(32.0)
    assert rx == pytest.approx(5_200 * 0.32)
    assert metrics(node, second, third, GRAPHICS)[0][1] == pytest.approx(64.0)
    assert metrics(node, first, second, 999)[0][0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    node.nvml.nvmlGpmSampleFree(first)
    with pytest.raises(pynvml.NVMLError) as freed:
        metrics(node, first, second, GRAPHICS)
    assert nvml_code(freed) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_gpm_in_mig_mode_is_per_gpu_instance(make_node: NodeFactory, clock: Clock) -> None:
    """In MIG mode the whole-GPU sample is refused and each GPU instance has its own counters:
    the busy instance reads its process's load over its own SMs, the idle one 0."""
    node = make_node("hgx-h200")
    handle = enable_mig(node)
    busy = node.nvml.nvmlGpuInstanceGetInfo(create_gi(node, handle, 9, (4, 4))).id
    idle = node.nvml.nvmlGpuInstanceGetInfo(create_gi(node, handle, 9, (0, 4))).id
    gi = node.nvml.nvmlDeviceGetGpuInstanceById(handle, busy)
    node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    device = next(d for d in node.describe()["gpus"][0]["mig_devices"] if d["gi_id"] == busy)
    node.add_process(device["uuid"], pid=301)  # 71 % of the instance it runs in
    with pytest.raises(pynvml.NVMLError) as refused:
        sample(node, handle)
    assert nvml_code(refused) == pynvml.NVML_ERROR_NOT_SUPPORTED
    before = {gi_id: sample(node, handle, gi_id) for gi_id in (busy, idle)}
    clock.now += 5
    after = {gi_id: sample(node, handle, gi_id) for gi_id in (busy, idle)}
    assert metrics(node, before[busy], after[busy], GRAPHICS)[0][1] == pytest.approx(71.0)
    assert metrics(node, before[idle], after[idle], GRAPHICS)[0][1] == 0.0
    with pytest.raises(pynvml.NVMLError) as mixed:
        metrics(node, before[busy], after[idle], GRAPHICS)
    assert nvml_code(mixed) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as missing:
        sample(node, handle, 12)
    assert nvml_code(missing) == pynvml.NVML_ERROR_NOT_FOUND


@pytest.mark.parametrize("preset", ["dgx-a100", "l40s"])
def test_gpm_before_hopper_says_unsupported(make_node: NodeFactory, preset: str) -> None:
    """The support query answers with the flag off; a sample is NOT_SUPPORTED."""
    node = make_node(preset)
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    assert node.nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError) as refused:
        sample(node, handle)
    assert nvml_code(refused) == pynvml.NVML_ERROR_NOT_SUPPORTED


OK, NS = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED
# preset -> status of (MEMORY_TEMP, NVLink RX all links, NVLink CRC errors, RETIRED_DBE)
FIELD_SUPPORT = {
    "hgx-h200": (OK, OK, OK, NS),
    "dgx-a100": (OK, OK, OK, NS),
    "a100-pcie-bridged": (OK, OK, OK, NS),
    "l40s": (NS, NS, NS, NS),  # GDDR6, no NVLink
}


@pytest.mark.parametrize(("preset", "expected"), FIELD_SUPPORT.items())
def test_field_values_carry_their_own_status(make_node: NodeFactory, preset: str,
                                             expected: tuple[int, ...]) -> None:
    """The call succeeds; each field says SUCCESS or NOT_SUPPORTED as the board has it."""
    node = make_node(preset)
    got = fields(node, 0, pynvml.NVML_FI_DEV_MEMORY_TEMP,
                 (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
                 pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
                 pynvml.NVML_FI_DEV_RETIRED_DBE)
    assert tuple(status for status, _ in got) == expected


def test_nvlink_counters_grow_with_the_load(make_node: NodeFactory, clock: Clock) -> None:
    """KiB counters: flat while idle, growing under load; one link is 1/18 of all links."""
    node = make_node("hgx-h200")
    rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    start = fields(node, 1, (rx, ALL_LINKS))[0][1]
    clock.now += 10
    assert fields(node, 1, (rx, ALL_LINKS))[0][1] == start
    node.add_process(node.gpu_uuids()[1], pid=300)
    clock.now += 10
    total = fields(node, 1, (rx, ALL_LINKS))[0][1]
    assert total - start == pytest.approx(42_000 * 0.64 * 10 * 1024, rel=1e-6)
    assert fields(node, 1, (rx, 3))[0][1] == pytest.approx(total / 18, abs=1)


def test_remapped_rows_and_replays_count_what_happened(h100: SimulatedNode) -> None:
    """XID 63 adds an uncorrectable remapped row, XID 64 the failure; replays add up; the
    field values and nvmlDeviceGetRemappedRows agree; a reset clears only the replays."""
    uuid = h100.gpu_uuids()[4]
    handle = h100.nvml.nvmlDeviceGetHandleByIndex(4)
    h100.inject_xid(uuid, 63)
    h100.inject_xid(uuid, 64)
    h100.add_pcie_replays(uuid, 3)
    assert h100.nvml.nvmlDeviceGetRemappedRows(handle) == (0, 1, 0, 1)
    assert [v for _, v in fields(h100, 4, pynvml.NVML_FI_DEV_REMAPPED_COR,
                                 pynvml.NVML_FI_DEV_REMAPPED_UNC,
                                 pynvml.NVML_FI_DEV_REMAPPED_FAILURE)] == [0, 1, 1]
    assert h100.nvml.nvmlDeviceGetPcieReplayCounter(handle) == 3
    h100.reset_gpu(uuid)
    assert h100.nvml.nvmlDeviceGetPcieReplayCounter(handle) == 0
    assert h100.nvml.nvmlDeviceGetRemappedRows(handle) == (0, 1, 0, 1)


@pytest.mark.parametrize(("preset", "pid", "expected"), [
    ("l40s", 300, [15 + 300 * 11 % 36, 10 + 300 * 13 % 31]),  # encodes and decodes
    ("dgx-h100", 300, [0, 10 + 300 * 13 % 31]),  # no NVENC on H100: 0 %
    ("dgx-h100", 301, [0, 0]),
])
def test_encoder_and_decoder_follow_the_processes(make_node: NodeFactory, preset: str,
                                                  pid: int, expected: list[int]) -> None:
    node = make_node(preset)
    node.add_process(node.gpu_uuids()[0], pid=pid)
    handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
    got = [node.nvml.nvmlDeviceGetEncoderUtilization(handle)[0],
           node.nvml.nvmlDeviceGetDecoderUtilization(handle)[0]]
    assert got == expected


def test_mig_mode_takes_utilisation_and_video_away(h100: SimulatedNode) -> None:
    """In MIG mode the whole GPU has no utilisation, encoder or decoder figures."""
    handle = enable_mig(h100)
    for call in (h100.nvml.nvmlDeviceGetUtilizationRates,
                 h100.nvml.nvmlDeviceGetEncoderUtilization,
                 h100.nvml.nvmlDeviceGetDecoderUtilization):
        with pytest.raises(pynvml.NVMLError) as refused:
            call(handle)
        assert nvml_code(refused) == pynvml.NVML_ERROR_NOT_SUPPORTED
