"""Agent overhead on MIG transitions against the hardware's own time.

A real ``gpu-agent serve --simulate dgx-h100`` process, with per-call simulator latencies
standing in for the driver's GI/CI create and destroy times. For each reconfiguration the
wall time from the PUT to the transition's terminal state is compared with the sum of the
simulated NVML mutation times on its critical path; then the same change on all 8 GPUs at once
(one ``/v1/mig/apply``) is compared with the single-GPU time (GPUs go in parallel).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class Agent:
    def __init__(self, state: Path, extra: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100", "--state-dir",
             str(state), "--listen", "127.0.0.1:0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listeners = state / "listeners.json"
        while not listeners.exists():
            time.sleep(0.01)
        url = json.loads(listeners.read_text())["listeners"][0]
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.token = (state / "tokens").read_text().split(":")[1].strip()
        while self.call("GET", "/readyz")[0] != 200:
            time.sleep(0.01)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Authorization": f"Bearer {self.token}",
                                  "Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def wait(self, path: str, done: str) -> dict[str, Any]:
        while True:
            _, body = self.call("GET", path)
            if body[done] if done == "terminal" else body["state"] != "running":
                return dict(body)
            time.sleep(0.002)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def _desired(profiles: list[str] | None) -> dict[str, Any]:
    return {"mig_enabled": False} if profiles is None else {"profiles": profiles}


def _config(profiles: list[str] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"devices": "all", "mig-enabled": profiles is not None}
    if profiles is not None:
        entry["mig-devices"] = {p: profiles.count(p) for p in sorted(set(profiles))}
    return {"version": "v1", "mig-configs": {"x": [entry]}}


def _set_all(agent: Agent, profiles: list[str] | None) -> float:
    started = time.perf_counter()
    status, body = agent.call("POST", "/v1/mig/apply", {"config": _config(profiles),
                                                        "label": "x"})
    if status != 202:
        raise RuntimeError(f"apply failed: {body}")
    result = agent.wait(f"/v1/mig/apply/{body['apply_id']}", "state")
    if result["state"] != "succeeded":
        raise RuntimeError(f"apply ended {result['state']}")
    return time.perf_counter() - started


def measure(agent: Agent, scenario: tuple[str, list[str] | None, list[str] | None]) -> Sample:
    name, start, end = scenario
    agent.call("PUT", "/v1/sim/latency", {})
    _set_all(agent, start)
    agent.call("PUT", "/v1/sim/latency", LATENCY_S)
    began = time.perf_counter()
    status, body = agent.call("PUT", "/v1/gpus/0/mig", _desired(end))
    if status != 202:
        raise RuntimeError(f"{name}: {status} {body}")
    done = agent.wait(f"/v1/transitions/{body['transition']['id']}", "terminal")
    one = time.perf_counter() - began
    if done["state"] != "succeeded":
        raise RuntimeError(f"{name}: {done['state']} {done['error']}")
    hardware = sum(_STEP_COST.get(s["name"].split()[0], 0.0) for s in done["steps"])
    agent.call("PUT", "/v1/sim/latency", {})
    _set_all(agent, start)
    agent.call("PUT", "/v1/sim/latency", LATENCY_S)
    every = _set_all(agent, end)
    return Sample(name, hardware, one, every)


def main(runs: int = 3) -> None:
    print(f"# MIG transition overhead: simulated latencies {LATENCY_S} s; median of {runs} "
          f"runs; {os.cpu_count()} CPUs {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"{'scenario':<26} {'hardware s':>10} {'1 GPU s':>9} {'ratio':>6} "
          f"{'overhead ms':>11} {'<=1.05x+20ms':>12} {'8 GPUs s':>9} {'8 vs 1':>7} "
          f"{'<=1.15x':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "state")
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
