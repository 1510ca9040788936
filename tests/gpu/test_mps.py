"""The hardware layer's MPS and nvidia-smi calls (MpsControl, NvidiaSmi, mps_processes,
compute_mode) against the simulated driver tools, run as real processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.errors import InvalidRequest, SharingUnavailable
from agent.gpu.mps import MpsControl, MpsDaemonSpec, ProcessUse, mps_processes
from agent.gpu.nvidia_smi import TIMESLICE, NvidiaSmi, compute_mode
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode

from .launcher import SubprocessLauncher

Reaper = Callable[[int], None]


@pytest.fixture
def l40s(tmp_path: Path, reap_daemons: Reaper) -> Iterator[tuple[SimulatedNode, NvmlSession]]:
    node = SimulatedNode("l40s", tmp_path / "state", tmp_path / "proc")
    session = NvmlSession(node.nvml)
    node.nvml.nvmlInit()
    yield node, session
    session.close()
    node.close()


def control(node: SimulatedNode, *, timeout_s: float = 15.0) -> MpsControl:
    return MpsControl(node.tools_dir / "nvidia-cuda-mps-control", SubprocessLauncher(),
                      timeout_s=timeout_s)


def spec(root: Path, devices: list[str], pct: int | None = None,
         limits: dict[str, int] | None = None) -> MpsDaemonSpec:
    return MpsDaemonSpec(root=root, devices=tuple(devices), active_thread_percentage=pct,
                         pinned_limits_mib=limits or {})


@pytest.mark.parametrize(("pct", "limits_gib"), [
    (None, {}),
    (50, {0: 10}),
    (25, {0: 10, 1: 4}),
])
async def test_start_applies_the_defaults_the_simulator_then_holds_clients_to(
        l40s: tuple[SimulatedNode, NvmlSession], tmp_path: Path, pct: int | None,
        limits_gib: dict[int, int]) -> None:
    """``start`` leaves a daemon on the spec's devices with its thread percentage and pinned
    limits, as the simulator reports them; a client above a limit is refused there."""
    node, _ = l40s
    gpus = node.gpu_uuids()[:2]
    limits = {gpus[i]: gib * 1024 for i, gib in limits_gib.items()}
    mps = control(node)
    await mps.start(spec(tmp_path / "mps" / "claim", gpus, pct, limits))
    [daemon] = node.describe()["mps_daemons"]
    assert daemon["devices"] == gpus
    assert daemon["defaults"] == {"active_thread_percentage": pct, "pinned_limits_mib": limits}
    assert (tmp_path / "mps" / "claim" / "shm").is_dir()
    for uuid, mib in limits.items():
        with pytest.raises(InvalidRequest):
            node.add_process(uuid, used_memory_mib=mib + 1,
                             mps_pipe_directory=daemon["pipe_directory"])
    client = node.add_process(gpus[0], used_memory_mib=1024,
                              mps_pipe_directory=daemon["pipe_directory"])
    assert client["mps"]["active_thread_percentage"] == (100 if pct is None else pct)


async def test_start_is_idempotent_and_stop_removes_everything(
        l40s: tuple[SimulatedNode, NvmlSession], tmp_path: Path) -> None:
    """A second start re-configures the daemon already answering (no second daemon);
    ``stop`` quits it and removes its directory; a second stop is a no-op."""
    node, _ = l40s
    mps = control(node)
    root = tmp_path / "mps" / "c"
    gpu = node.gpu_uuids()[0]
    await mps.start(spec(root, [gpu], 50))
    await mps.start(spec(root, [gpu], 70))
    [daemon] = node.describe()["mps_daemons"]
    assert daemon["defaults"]["active_thread_percentage"] == 70
    assert await mps.alive(root)
    assert await mps.servers(root) == []
    assert await mps.command(root, "get_default_active_thread_percentage") == "70.0"
    await mps.stop(root)
    assert not root.exists()
    assert not await mps.alive(root)
    assert node.describe()["mps_daemons"] == []
    await mps.stop(root)


async def test_servers_and_clients_match_nvml(l40s: tuple[SimulatedNode, NvmlSession],
                                              tmp_path: Path) -> None:
    """``servers``/``clients`` answer what NVML reports: the server in the compute processes,
    the clients (with their memory) in the MPS processes."""
    node, session = l40s
    mps = control(node)
    root = tmp_path / "mps" / "c"
    gpu = node.gpu_uuids()[0]
    await mps.start(spec(root, [gpu]))
    pids = [node.add_process(gpu, used_memory_mib=mib, mps_pipe_directory=str(root / "pipe"))
            ["pid"] for mib in (1024, 2048)]
    [server] = await mps.servers(root)
    assert sorted(await mps.clients(root, server)) == sorted(pids)
    assert sorted(await session.read(lambda: mps_processes(session, gpu)),
                  key=lambda p: p.pid) == [ProcessUse(pids[0], 1024), ProcessUse(pids[1], 2048)]


async def test_a_failed_start_is_sharing_unavailable_and_leaves_nothing(
        l40s: tuple[SimulatedNode, NvmlSession], tmp_path: Path) -> None:
    """A ``-d`` that fails (an injected fault) is SharingUnavailable with the tool's message;
    no daemon runs and the daemon's directory is gone."""
    node, _ = l40s
    node.add_fault("nvidia-cuda-mps-control", "MPS control daemon could not start")
    root = tmp_path / "mps" / "c"
    with pytest.raises(SharingUnavailable) as failed:
        await control(node).start(spec(root, node.gpu_uuids()[:1], 50))
    assert failed.value.tool == "nvidia-cuda-mps-control"
    assert "MPS control daemon could not start" in failed.value.detail
    assert node.describe()["mps_daemons"] == []
    assert not root.exists()


async def test_a_limit_the_daemon_refuses_is_sharing_unavailable_and_the_daemon_stopped(
        l40s: tuple[SimulatedNode, NvmlSession], tmp_path: Path) -> None:
    """A default the daemon refuses (a device it does not serve) fails the start; what the
    start launched is stopped."""
    node, _ = l40s
    root = tmp_path / "mps" / "c"
    with pytest.raises(SharingUnavailable, match="Invalid device"):
        await control(node).start(spec(root, node.gpu_uuids()[:1], None,
                                       {node.gpu_uuids()[2]: 1024}))
    assert node.describe()["mps_daemons"] == []


@pytest.mark.parametrize("missing", ["control", "smi"])
async def test_a_missing_binary_is_sharing_unavailable(tmp_path: Path, missing: str) -> None:
    """No binary at the path: not available, and every call says so."""
    absent = tmp_path / "no-such-tool"
    if missing == "control":
        mps = MpsControl(absent, SubprocessLauncher())
        assert not mps.available()
        with pytest.raises(SharingUnavailable) as failed:
            await mps.start(spec(tmp_path / "mps", ["GPU-x"]))
        assert not await mps.alive(tmp_path / "mps")
    else:
        smi = NvidiaSmi(absent)
        assert not smi.available()
        with pytest.raises(SharingUnavailable) as failed:
            await smi.set_timeslice("GPU-x", 1)
    assert failed.value.reason == "missing"


@pytest.mark.parametrize(("mode"), ["EXCLUSIVE_PROCESS", "PROHIBITED", "DEFAULT"])
async def test_set_compute_mode_is_what_nvml_reads(l40s: tuple[SimulatedNode, NvmlSession],
                                                   mode: str) -> None:
    """``NvidiaSmi.set_compute_mode`` then ``compute_mode`` (NVML) agree."""
    node, session = l40s
    gpu = node.gpu_uuids()[1]
    smi = NvidiaSmi(node.tools_dir / "nvidia-smi")
    assert smi.available()
    await smi.set_compute_mode(gpu, "PROHIBITED" if mode == "DEFAULT" else "DEFAULT")
    await smi.set_compute_mode(gpu, mode)  # type: ignore[arg-type]
    assert await session.read(lambda: compute_mode(session, gpu)) == mode


@pytest.mark.parametrize("interval", list(TIMESLICE))
async def test_set_timeslice_sets_the_interval(l40s: tuple[SimulatedNode, NvmlSession],
                                               interval: str) -> None:
    """Each interval's value lands on that GPU."""
    node, _ = l40s
    await NvidiaSmi(node.tools_dir / "nvidia-smi").set_timeslice(node.gpu_uuids()[0],
                                                                 TIMESLICE[interval])
    assert node.describe()["gpus"][0]["timeslice"] == TIMESLICE[interval]


async def test_a_failing_nvidia_smi_is_sharing_unavailable_with_its_output(
        l40s: tuple[SimulatedNode, NvmlSession]) -> None:
    """A non-zero exit is SharingUnavailable naming the tool, the GPU and its output."""
    node, _ = l40s
    gpu = node.gpu_uuids()[0]
    node.add_fault("nvidia-smi", "Insufficient Permissions")
    with pytest.raises(SharingUnavailable) as failed:
        await NvidiaSmi(node.tools_dir / "nvidia-smi").set_compute_mode(gpu, "EXCLUSIVE_PROCESS")
    assert (failed.value.tool, failed.value.gpu) == ("nvidia-smi", gpu)
    assert "Insufficient Permissions" in failed.value.detail


async def test_a_hung_tool_is_killed_at_its_deadline(l40s: tuple[SimulatedNode, NvmlSession],
                                                     tmp_path: Path) -> None:
    """A tool that outlives ``timeout_s`` is killed and reported as timed out."""
    node, _ = l40s
    node.set_latency({"nvidia-smi": 5.0})
    with pytest.raises(SharingUnavailable) as failed:
        await NvidiaSmi(node.tools_dir / "nvidia-smi", timeout_s=0.5).set_timeslice(
            node.gpu_uuids()[0], 1)
    assert failed.value.reason == "timed out"
    assert node.describe()["gpus"][0]["timeslice"] == 0


async def test_a_killed_daemon_is_no_longer_alive(l40s: tuple[SimulatedNode, NvmlSession],
                                                  tmp_path: Path) -> None:
    """After SIGKILL of the daemon, ``alive`` is false and ``stop`` only removes the root."""
    node, _ = l40s
    mps = control(node)
    root = tmp_path / "mps" / "c"
    await mps.start(spec(root, node.gpu_uuids()[:1]))
    os.kill(int((root / "pipe" / "nvidia-cuda-mps-control.pid").read_text()), signal.SIGKILL)
    assert not await mps.alive(root)
    await mps.stop(root)
    assert not root.exists()
