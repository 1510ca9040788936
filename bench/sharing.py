"""Sharing: prepare latency of an MPS claim, daemon start included, beside a plain claim.

A real ``gpu-agent serve --simulate l40s --gpu-shares`` process (simulated NVML latencies
off; the simulator's ``nvidia-cuda-mps-control`` is a real process, so an MPS prepare pays
for starting one and for the control commands that set and read back its limits). Each
sample prepares three claims one after another over the agent's socket, each on a GPU of
its own, with the kubelet plugin's mapping (``agent.kubeplugin.claims``) from a
ResourceClaim as the scheduler leaves it, and unprepares each after it:

- **plain**: a whole L40S, no config;
- **MPS**: a whole L40S with an opaque ``GpuConfig`` (MPS, 50 % of the threads, 10Gi
  pinned): one control daemon started for the claim, stopped at unprepare;
- **share**: ``memory: 10Gi`` of an L40S (consumable capacity: a ``shareID`` and
  ``consumedCapacity``), enforced with an implicit MPS daemon.

The three rotate sample by sample, so all see the same machine at the same time; the
medians and their ratio to the plain claim's are the result. Beside them, one call of the
simulator's ``nvidia-cuda-mps-control`` (a ``get_server_list`` that finds no daemon): what
each control command costs here, a Python process start; an MPS prepare makes about eight
such calls (``agent/gpu/mps.py``: a liveness check, ``-d``, the start check, two settings
and their read-backs, and ``nvidia-smi -c``), where NVIDIA's are C programs.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.kubeplugin.claims import (
    CONFIG_API_VERSION,
    KubeletClaim,
    agent_body,
    our_devices,
    with_configs,
)
from tests.agent_process import AgentProcess, start_agent

SAMPLES = 30
DRIVER = "gpu.nodeagent.dev"
NODE = "bench-node"
MPS = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
       "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                                    "defaultPinnedDeviceMemoryLimit": "10Gi"}}}


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    gpu: int


KINDS = (Kind("plain", "whole L40S, no config", 0),
         Kind("mps", "whole L40S, GpuConfig MPS 50 % / 10Gi (daemon start)", 1),
         Kind("share", "memory: 10Gi share of an L40S (implicit MPS daemon)", 2))


def resource_claim(kind: Kind, uid: str) -> dict[str, Any]:
    """The ResourceClaim of one sample as the scheduler leaves it (allocation written)."""
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE,
                              "device": f"gpu-{kind.gpu}"}
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if kind.name == "share":
        result.update(shareID=str(uuid.uuid4()), consumedCapacity={"memory": "10Gi"})
    if kind.name == "mps":
        allocation["devices"]["config"] = [{"source": "FromClaim", "requests": ["gpu"],
                                            "opaque": {"driver": DRIVER, "parameters": MPS}}]
    return {"metadata": {"name": f"bench-{kind.name}", "namespace": "default", "uid": uid,
                         "resourceVersion": "1"},
            "status": {"allocation": allocation}}


def body_of(kind: Kind, uid: str) -> dict[str, Any]:
    """What the kubelet plugin sends the agent for this claim."""
    claim = KubeletClaim("default", uid, f"bench-{kind.name}")
    obj = resource_claim(kind, uid)
    devices = with_configs(claim, obj, our_devices(claim, obj, driver=DRIVER, pool=NODE),
                           driver=DRIVER)
    return agent_body(claim, obj, devices, time.clock_gettime_ns(time.CLOCK_BOOTTIME))


@dataclass
class Samples:
    prepare_s: list[float]
    unprepare_s: list[float]
    errors: list[str]


def _one(agent: AgentProcess, kind: Kind, samples: Samples) -> None:
    uid = str(uuid.uuid4())
    body = body_of(kind, uid)
    started = time.perf_counter()
    reply = agent.request("PUT", f"/v1/claims/{uid}", body)
    prepared = time.perf_counter() - started
    if reply.status != 200:
        samples.errors.append(f"{reply.status} {str(reply.body)[:200]}")
        return
    started = time.perf_counter()
    gone = agent.request("DELETE", f"/v1/claims/{uid}")
    unprepared = time.perf_counter() - started
    if gone.status not in (200, 204):
        samples.errors.append(f"unprepare {gone.status} {str(gone.body)[:200]}")
        return
    samples.prepare_s.append(prepared)
    samples.unprepare_s.append(unprepared)


def _tool_call_s(tools: Path, pipe: Path) -> float:
    """One ``get_server_list`` of the simulator's control tool, start to exit."""
    started = time.perf_counter()
    subprocess.run([str(tools / "nvidia-cuda-mps-control")], input=b"get_server_list\n",
                   env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
                   capture_output=True, timeout=30, check=False)
    return time.perf_counter() - started


def run(samples: int = SAMPLES) -> dict[str, Samples]:
    """Every kind's samples, interleaved, against one agent process; ``tool`` holds the
    control tool's calls (in ``prepare_s``)."""
    found = {k.name: Samples([], [], []) for k in KINDS}
    found["tool"] = Samples([], [], [])
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as tmp:
        directory = Path(tmp)
        agent = start_agent(directory / "agent-state", preset="l40s",
                            extra=["--gpu-shares", "--node-name", NODE,
                                   "--cdi-dir", str(directory / "cdi")])
        try:
            agent.request("PUT", "/v1/sim/latency", {})
            for kind in KINDS:  # one warm-up each, not counted
                _one(agent, kind, Samples([], [], []))
            tools = directory / "agent-state" / "sim" / "bin"
            for _ in range(samples):
                for kind in KINDS:
                    _one(agent, kind, found[kind.name])
                if (tools / "nvidia-cuda-mps-control").exists():
                    found["tool"].prepare_s.append(_tool_call_s(tools, directory / "no-daemon"))
        finally:
            agent.stop()
    return found


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "       -"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:8.2f}"


def machine() -> str:
    load = os.getloadavg()[0]
    return (f"{os.cpu_count()} CPUs {platform.machine()}, Python {platform.python_version()}, "
            f"1-minute load {load:.2f} at the start")


def main(samples: int = SAMPLES) -> None:
    header = machine()
    found = run(samples)
    print("# Sharing: prepare of an MPS claim (daemon start included) beside a plain claim; "
          f"simulated l40s, REST over the agent's socket; {header}")
    print(f"{'claim':<58}{'n':>4}{'prep p50':>10}{'p90':>9}{'unprep p50':>12}{'p90':>9}"
          f"{'vs plain':>10}")
    plain = found["plain"].prepare_s
    base = statistics.median(plain) if plain else None
    for kind in KINDS:
        got = found[kind.name]
        ratio = (f"{statistics.median(got.prepare_s) / base:9.1f}x"
                 if base and got.prepare_s else "        -")
        print(f"{kind.name + ': ' + kind.what:<58}{len(got.prepare_s):>4}"
              f"{_ms(got.prepare_s, 0.5):>10}{_ms(got.prepare_s, 0.9):>9}"
              f"{_ms(got.unprepare_s, 0.5):>12}{_ms(got.unprepare_s, 0.9):>9}{ratio:>10}")
    tool = found["tool"].prepare_s
    if tool:
        print(f"{'one sim nvidia-cuda-mps-control call (get_server_list)':<58}"
              f"{len(tool):>4}{_ms(tool, 0.5):>10}{_ms(tool, 0.9):>9}")
    for kind in KINDS:
        errors = found[kind.name].errors
        if errors:
            print(f"  {kind.name}: {len(errors)} refused, first: {errors[0]}")
