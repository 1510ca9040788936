"""The agent's MpsControl starting the simulator's nvidia-cuda-mps-control through the MPS
host: the daemon applies the claim's limits and lives in the host's cgroup, not the caller's;
a claim's two MPS configs run two daemons. (Needs the simulated MPS tools of agent/gpu/sim,
issue 16.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .processes import cgroups, in_cgroup, require_cgroup2, start_host, stop_daemons

mps = pytest.importorskip("agent.gpu.mps")
node_module = pytest.importorskip("agent.gpu.sim.node")

from agent.claims.checkpoint import ClaimRecord  # noqa: E402
from agent.claims.sharing import MpsConfig, SharingConfig, Target, plan  # noqa: E402
from agent.claims.sharing_runtime import SharingRuntime  # noqa: E402
from agent.mps.host_client import HostLauncher  # noqa: E402
from tests.claims.fake_tools import FakeSmi  # noqa: E402


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


def test_two_mps_configs_of_a_claim_run_two_daemons_through_the_host(
        tmp_path: Path, l40s: object) -> None:
    """A claim with two MPS configs (issue 24: one shared daemon at beeb01d) starts two
    daemons through the host, each on its own pipe and log directories with its own
    defaults, as NVIDIA's driver isolates each config; undoing the claim stops both."""
    node: object = l40s
    binary = node.tools_dir / "nvidia-cuda-mps-control"  # type: ignore[attr-defined]
    root = tmp_path / "mps"
    root.mkdir()
    first, second = node.gpu_uuids()[:2]  # type: ignore[attr-defined]
    shared = plan([
        Target(position=0, uuid=first, gpu=first, kind="gpu", memory_mib=46068,
               sharing=SharingConfig("MPS", mps=MpsConfig(thread_percentage=30,
                                                           pinned_mib=2048))),
        Target(position=1, uuid=second, gpu=second, kind="gpu", memory_mib=46068,
               sharing=SharingConfig("MPS", mps=MpsConfig(thread_percentage=70)))])
    host = start_host(tmp_path, mps_root=root, mps_control=binary, flags=("--private-shm",))
    try:
        runtime = SharingRuntime(nvidia_smi=FakeSmi(), mps=mps.MpsControl(
            binary, HostLauncher(host.socket)), mps_root=root)
        record = ClaimRecord(uid="c2", state="prepare_started", devices=[],
                             request_digest="d", created_at=0.0, updated_at=0.0)
        record.set_daemons(runtime.daemon_records("c2", shared))
        asyncio.run(runtime.apply(record))
        daemons = {d["pipe_directory"]: d
                   for d in node.describe()["mps_daemons"]}  # type: ignore[attr-defined]
        roots = [Path(d.root) for d in record.daemons()]
        assert len(set(roots)) == 2 and all(r.parent == root for r in roots)
        assert sorted(daemons) == sorted(str(r / "pipe") for r in roots)
        one, other = (daemons[str(r / "pipe")] for r in roots)
        assert (one["devices"], one["log_directory"], one["defaults"]) == (
            [first], str(roots[0] / "log"),
            {"active_thread_percentage": 30, "pinned_limits_mib": {first: 2048}})
        assert (other["devices"], other["log_directory"], other["defaults"]) == (
            [second], str(roots[1] / "log"),
            {"active_thread_percentage": 70, "pinned_limits_mib": {}})
        asyncio.run(runtime.undo(record, lambda gpu, what: False))
        assert node.describe()["mps_daemons"] == []  # type: ignore[attr-defined]
        assert not any(r.exists() for r in roots)
    finally:
        host.stop()
        stop_daemons(root)
