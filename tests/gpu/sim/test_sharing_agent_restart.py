"""A real agent process over a simulated L40S: the sharing state of its simulated hardware
(an MPS daemon with a client, a compute mode, a time slice) outlives a SIGKILL of the agent's
whole process group, and the restarted agent's simulator reports it unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.agent_process import start_agent


def test_sharing_state_survives_killing_the_agent_group(
        tmp_path: Path, reap_daemons: Callable[[int], None]) -> None:
    """Kill the agent as a runtime would (its process group), start it again: the daemon
    still runs and serves, its client and server are still reported, compute mode and time
    slice are as set."""
    state = tmp_path / "state"
    agent = start_agent(state, preset="l40s")
    try:
        tools = state / "sim" / "bin"
        gpu = agent.request("GET", "/v1/sim").body["gpus"][0]["uuid"]
        env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"), "CUDA_VISIBLE_DEVICES": gpu}
        for argv in ([tools / "nvidia-smi", "-i", gpu, "-c", "EXCLUSIVE_PROCESS"],
                     [tools / "nvidia-smi", "compute-policy", "-i", gpu, "--set-timeslice", "1"],
                     [tools / "nvidia-cuda-mps-control", "-d"]):
            assert subprocess.run(argv, env=env, timeout=30, check=False).returncode == 0
        client = agent.request("POST", "/v1/sim/processes", {
            "device": gpu, "used_memory_mib": 2048,
            "mps_pipe_directory": str(tmp_path / "pipe"), "uid": 1000})
        assert client.status == 201, client.body
        before = agent.request("GET", "/v1/sim").body
    finally:
        os.killpg(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(timeout=20)
    agent = start_agent(state, preset="l40s")
    try:
        after = agent.request("GET", "/v1/sim").body
        assert after["mps_daemons"] == before["mps_daemons"] != []
        assert (after["gpus"][0]["compute_mode"], after["gpus"][0]["timeslice"]) == (
            "EXCLUSIVE_PROCESS", 1)
        servers = subprocess.run([tools / "nvidia-cuda-mps-control"], env=env,
                                 input="get_server_list\n", capture_output=True, text=True,
                                 timeout=30, check=False)
        assert servers.stdout.split() == [str(client.body["mps"]["server"])]
    finally:
        agent.stop()
