"""Telemetry that follows the load: utilisation from the attached processes, and power,
temperature and clocks from utilisation. Deterministic: the same load reads the same values,
so the energy counter (power integrated over wall time) only ever grows."""

from __future__ import annotations

from collections.abc import Iterable

from agent.gpu.sim.presets import GpuModel

# Memory a GPU or MIG device shows as used with nothing running (driver contexts).
RESERVED_GPU_MIB = 5
RESERVED_MIG_MIB = 13


def process_utilization(pid: int) -> int:
    """How busy one process keeps the SMs it runs on: 55-95 %, fixed per pid."""
    return 55 + pid * 7 % 41


def gpu_utilization(shares: Iterable[tuple[int, float]]) -> int:
    """GPU utilisation from (pid, share of the GPU's SMs the process can use) pairs."""
    return min(100, round(sum(process_utilization(pid) * share for pid, share in shares)))


def memory_utilization(gpu_util: int) -> int:
    """Memory-controller busy percentage: compute kernels keep it busy about half the time."""
    return gpu_util * 11 // 20


def power_mw(model: GpuModel, util: int) -> int:
    return (model.idle_power_w * 1000
            + (model.tdp_w - model.idle_power_w) * 1000 * util // 100)


def temperature_c(model: GpuModel, util: int) -> int:
    return model.idle_temp_c + (model.load_temp_c - model.idle_temp_c) * util // 100


def sm_clock_mhz(model: GpuModel, util: int) -> int:
    """Idle clock with nothing running; boosts to the maximum at modest load."""
    if util == 0:
        return model.sm_clock_idle_mhz
    span = model.sm_clock_max_mhz - model.sm_clock_idle_mhz
    return model.sm_clock_idle_mhz + span * min(util, 30) // 30


def energy_mj(counter_mj: int, counter_at: float, power: int, now: float) -> int:
    """The energy counter: its value at the last load change plus constant power since."""
    return counter_mj + int(power * max(0.0, now - counter_at))


def memory_temperature_c(model: GpuModel, util: int) -> int:
    """HBM temperature: a few degrees above the GPU's at idle, further under load (memory
    sits next to the die and is cooled through it)."""
    idle = model.idle_temp_c + 3
    return idle + (model.load_temp_c + 8 - idle) * util // 100


def process_video(pid: int) -> tuple[int, int]:
    """(encoder, decoder) percentages one process keeps busy, fixed per pid: most compute
    jobs use neither; about one in three decodes (data loading), one in five encodes."""
    decode = 10 + pid * 13 % 31 if pid % 3 == 0 else 0
    encode = 15 + pid * 11 % 36 if pid % 5 == 0 else 0
    return encode, decode


def video_utilization(pids: Iterable[int], engines: int, *, encoder: bool) -> int:
    """Encoder or decoder utilisation of a GPU with ``engines`` such engines (0: none, as
    NVENC on A100/H100, which NVML reports as 0 %)."""
    if engines == 0:
        return 0
    return min(100, sum(process_video(pid)[0 if encoder else 1] for pid in pids))


#: Activity counter -> fraction of the utilisation it follows. The GPM metrics are the mean
#: of these rates between two samples; percentages for the engines, MiB/s for the links.
ACTIVITY_PERCENT: dict[str, float] = {
    "graphics": 1.0, "sm": 0.92, "occupancy": 0.38, "integer": 0.12, "tensor": 0.61,
    "dram": 0.55, "fp64": 0.04, "fp32": 0.27, "fp16": 0.49,
}
# MiB/s at 100 % utilisation of a whole GPU (an instance moves its share of it).
PCIE_TX_MIB_S = 1_800.0
PCIE_RX_MIB_S = 5_200.0
NVLINK_MIB_S = 42_000.0


def activity_rates(util: int, share: float, nvlink: bool) -> dict[str, float]:
    """What a device with utilisation ``util`` (%) does per second: engine percentages, and
    PCIe/NVLink MiB/s scaled by its ``share`` of the GPU; no NVLink traffic without links."""
    rates = {name: util * fraction for name, fraction in ACTIVITY_PERCENT.items()}
    rates["pcie_tx"] = PCIE_TX_MIB_S * share * util / 100
    rates["pcie_rx"] = PCIE_RX_MIB_S * share * util / 100
    link = NVLINK_MIB_S * share * util / 100 if nvlink else 0.0
    rates["nvlink_tx"] = rates["nvlink_rx"] = link
    return rates
