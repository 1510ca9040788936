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
