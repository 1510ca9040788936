"""Agent overhead on MIG transitions against the hardware's own time.

A real ``gpu-agent serve --simulate dgx-h100`` process, with per-call simulator latencies
standing in for the driver's GI/CI create and destroy times. For each reconfiguration the
wall time from the PUT to the transition's terminal state is compared with the sum of the
simulated NVML mutation times on its critical path; then the same change on all 8 GPUs at once
(one ``/v1/mig/apply``) is compared with the single-GPU time (GPUs go in parallel).
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, start_agent

LATENCY_S = {
    "nvmlDeviceCreateGpuInstanceWithPlacement": 0.4,
    "nvmlGpuInstanceDestroy": 0.2,
    "nvmlGpuInstanceCreateComputeInstance": 0.1,
    "nvmlComputeInstanceDestroy": 0.05,
}
# (name, from, to): profiles, or None for MIG off.
SCENARIOS: tuple[tuple[str, list[str] | None, list[str] | None], ...] = (
    ("off -> 3g+2g+1g+1g", None, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
    ("3g+2g+1g+1g -> 7g", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], ["7g.80gb"]),
    ("7g -> 3g+2g+1g+1g", ["7g.80gb"], ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
    ("3g+2g+1g+1g -> 3g+4x1g", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
     ["3g.40gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"]),
)
_STEP_COST = {"destroy_ci": LATENCY_S["nvmlComputeInstanceDestroy"],
              "destroy_gi": LATENCY_S["nvmlGpuInstanceDestroy"],
              "create_gi": LATENCY_S["nvmlDeviceCreateGpuInstanceWithPlacement"],
              "create_ci": LATENCY_S["nvmlGpuInstanceCreateComputeInstance"]}


@dataclass(frozen=True)
class Sample:
    scenario: str
    hardware_s: float
    one_gpu_s: float
    all_gpus_s: float


def _desired(profiles: list[str] | None) -> dict[str, Any]:
    return {"mig_enabled": False} if profiles is None else {"profiles": profiles}


def _config(profiles: list[str] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"devices": "all", "mig-enabled": profiles is not None}
    if profiles is not None:
        entry["mig-devices"] = {p: profiles.count(p) for p in sorted(set(profiles))}
    return {"version": "v1", "mig-configs": {"x": [entry]}}


def _set_all(agent: AgentProcess, profiles: list[str] | None) -> float:
    started = time.perf_counter()
    reply = agent.request("POST", "/v1/mig/apply", {"config": _config(profiles), "label": "x"})
    if reply.status != 202:
        raise RuntimeError(f"apply failed: {reply.body}")
    result = agent.poll(f"/v1/mig/apply/{reply.body['apply_id']}",
                        lambda body: body["state"] != "running")
    if result["state"] != "succeeded":
        raise RuntimeError(f"apply ended {result['state']}")
    return time.perf_counter() - started


def measure(agent: AgentProcess,
            scenario: tuple[str, list[str] | None, list[str] | None]) -> Sample:
    name, start, end = scenario
    agent.request("PUT", "/v1/sim/latency", {})
    _set_all(agent, start)
    agent.request("PUT", "/v1/sim/latency", LATENCY_S)
    began = time.perf_counter()
    reply = agent.request("PUT", "/v1/gpus/0/mig", _desired(end))
    if reply.status != 202:
        raise RuntimeError(f"{name}: {reply.status} {reply.body}")
    done = agent.poll(f"/v1/transitions/{reply.body['transition']['id']}",
                      lambda body: body["terminal"])
    one = time.perf_counter() - began
    if done["state"] != "succeeded":
        raise RuntimeError(f"{name}: {done['state']} {done['error']}")
    hardware = sum(_STEP_COST.get(s["name"].split()[0], 0.0) for s in done["steps"])
    agent.request("PUT", "/v1/sim/latency", {})
    _set_all(agent, start)
    agent.request("PUT", "/v1/sim/latency", LATENCY_S)
    every = _set_all(agent, end)
    return Sample(name, hardware, one, every)


def figures(runs: int = 1, scenarios: int = len(SCENARIOS)) -> dict[str, float]:
    """For ``bench.compare``: the agent's overhead (wall time minus the simulated hardware
    time) of the first ``scenarios`` changes, on one GPU and on all 8 at once, median of
    ``runs``; name -> ms, lower is better."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(Path(tmp) / "state")
        try:
            for scenario in SCENARIOS[:scenarios]:
                samples = [measure(agent, scenario) for _ in range(runs)]
                hardware = samples[0].hardware_s
                one = statistics.median(s.one_gpu_s for s in samples)
                every = statistics.median(s.all_gpus_s for s in samples)
                out[f"1 GPU overhead ms: {scenario[0]}"] = (one - hardware) * 1e3
                out[f"8 GPUs overhead ms: {scenario[0]}"] = (every - hardware) * 1e3
        finally:
            agent.stop()
    return out


def main(runs: int = 3) -> None:
    print(f"# MIG transition overhead: simulated latencies {LATENCY_S} s; median of {runs} "
          f"runs; {os.cpu_count()} CPUs {platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"{'scenario':<26} {'hardware s':>10} {'1 GPU s':>9} {'ratio':>6} "
          f"{'overhead ms':>11} {'<=1.05x+20ms':>12} {'8 GPUs s':>9} {'8 vs 1':>7} "
          f"{'<=1.15x':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(Path(tmp) / "state")
        try:
            for scenario in SCENARIOS:
                samples = [measure(agent, scenario) for _ in range(runs)]
                hardware = samples[0].hardware_s
                one = statistics.median(s.one_gpu_s for s in samples)
                every = statistics.median(s.all_gpus_s for s in samples)
                within = "yes" if one <= 1.05 * hardware + 0.020 else "NO"
                parallel = "yes" if every <= 1.15 * one else "NO"
                print(f"{scenario[0]:<26} {hardware:>10.3f} {one:>9.3f} {one / hardware:>6.3f} "
                      f"{(one - hardware) * 1000:>11.1f} {within:>12} {every:>9.3f} "
                      f"{every / one:>7.3f} {parallel:>7}")
        finally:
            agent.stop()


if __name__ == "__main__":
    main()
