"""The agent's MpsControl starting the simulator's nvidia-cuda-mps-control through the MPS
host: the daemon applies the claim's limits and lives in the host's cgroup, not the caller's.
(Needs the simulated MPS tools of agent/gpu/sim, issue 16.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .processes import cgroups, in_cgroup, require_cgroup2, start_host, stop_daemons

mps = pytest.importorskip("agent.gpu.mps")
node_module = pytest.importorskip("agent.gpu.sim.node")

from agent.mps.host_client import HostLauncher  # noqa: E402


@pytest.fixture
def l40s(tmp_path: Path) -> Iterator[object]:
    node = node_module.SimulatedNode("l40s", tmp_path / "state", tmp_path / "proc")
    node.nvml.nvmlInit()
    yield node
    node.close()


def test_mps_control_through_the_host_starts_a_daemon_outside_the_caller_s_cgroup(
        tmp_path: Path, l40s: object) -> None:
    """MpsControl with a HostLauncher starts the simulated daemon with the claim's thread
    percentage and pinned limit (as the simulator reports them), in the host's cgroup, with
    --private-shm; stop quits it and removes its directories."""
    require_cgroup2()
    node: object = l40s
    binary = node.tools_dir / "nvidia-cuda-mps-control"  # type: ignore[attr-defined]
    root = tmp_path / "mps"
    root.mkdir()
    with cgroups("host") as groups:
        host = start_host(tmp_path, mps_root=root, mps_control=binary,
                          flags=("--private-shm",), cgroup=groups["host"])
        try:
            control = mps.MpsControl(binary, HostLauncher(host.socket))
            gpu = node.gpu_uuids()[0]  # type: ignore[attr-defined]
            spec = mps.MpsDaemonSpec(root=root / "0123456789ab", devices=(gpu,),
                                     active_thread_percentage=25,
                                     pinned_limits_mib={gpu: 10240})
            asyncio.run(control.start(spec))
            [daemon] = node.describe()["mps_daemons"]  # type: ignore[attr-defined]
            assert daemon["defaults"] == {"active_thread_percentage": 25,
                                          "pinned_limits_mib": {gpu: 10240}}
            assert in_cgroup(daemon["pid"]).endswith(f"/{groups['host'].name}")
            assert in_cgroup(daemon["pid"]) != in_cgroup(os.getpid())
            asyncio.run(control.stop(spec.root))
            assert not spec.root.exists()
            assert node.describe()["mps_daemons"] == []  # type: ignore[attr-defined]
        finally:
            host.stop()
            stop_daemons(root)
