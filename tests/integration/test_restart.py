"""A killed agent restarts onto the same (simulated) hardware."""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

import pynvml

from agent.gpu.sim.node import SimulatedNode
from tests.agent_process import start_agent


def _make_mig_layout(state_dir: Path) -> None:
    """Enable MIG on GPU 0 and create 3g.40gb@0:4 and 2g.20gb@4:2, as nvidia-smi would."""
    with SimulatedNode("dgx-h100", state_dir, state_dir / "proc") as node:
        nvml = node.nvml
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        for profile_id, start, size in ((9, 0, 4), (14, 4, 2)):
            placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id,
                                                               ctypes.byref(placement))
            nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2 if profile_id == 9 else 1)
        nvml.nvmlShutdown()


def test_sigkill_then_restart_keeps_mig_instances_and_identity(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _make_mig_layout(state)
    agent = start_agent(state)
    before = agent.request("GET", "/v1/gpus/0", token=None).body
    assert [(d["profile"], d["placement"]) for d in before["mig_devices"]] == [
        ("3g.40gb", {"start": 0, "size": 4}), ("2g.20gb", {"start": 4, "size": 2})]
    token = agent.token
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL

    again = start_agent(state)
    after = again.request("GET", "/v1/gpus/0", token=None).body
    assert after == before  # same UUIDs, MIG devices, placements
    assert again.token == token  # the generated token survives too
    assert again.request("GET", "/v1/sim").status == 200
    assert again.stop() == 0
