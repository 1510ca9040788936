"""The simulated ``nvidia-smi`` is a real executable: it changes the simulated hardware's
compute mode and time slice (NVML reads them back, a restarted node keeps them, a driver
reload clears them), exits as the real tool does, and fails when a fault says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pynvml
import pytest

from agent.gpu.sim.node import SimulatedNode

from .conftest import NodeFactory, enable_mig


def smi(node: SimulatedNode, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the node's nvidia-smi wrapper with a bare environment (as the agent would)."""
    return subprocess.run([str(node.tools_dir / "nvidia-smi"), *args], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30, check=False)


def mode_of(node: SimulatedNode, uuid: str) -> int:
    return int(node.nvml.nvmlDeviceGetComputeMode(node.nvml.nvmlDeviceGetHandleByUUID(uuid)))


def gpu_state(node: SimulatedNode, index: int) -> dict[str, object]:
    return next(g for g in node.describe()["gpus"] if g["index"] == index)


@pytest.mark.parametrize(("mode", "nvml"), [
    ("EXCLUSIVE_PROCESS", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
    ("PROHIBITED", pynvml.NVML_COMPUTEMODE_PROHIBITED),
    ("DEFAULT", pynvml.NVML_COMPUTEMODE_DEFAULT),
    ("3", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
    ("2", pynvml.NVML_COMPUTEMODE_PROHIBITED),
    ("0", pynvml.NVML_COMPUTEMODE_DEFAULT),
])
def test_compute_mode_set_by_nvidia_smi_is_what_nvml_reports(make_node: NodeFactory, mode: str,
                                                              nvml: int) -> None:
    """``nvidia-smi -i <uuid> -c <mode>`` (name or number) sets the mode NVML returns."""
    node = make_node("l40s")
    uuid = node.gpu_uuids()[1]
    if nvml == pynvml.NVML_COMPUTEMODE_DEFAULT:
        assert smi(node, "-i", uuid, "-c", "EXCLUSIVE_PROCESS").returncode == 0
    done = smi(node, "-i", uuid, "-c", mode)
    assert done.returncode == 0, done.stderr
    assert "All done." in done.stdout
    assert mode_of(node, uuid) == nvml
    assert mode_of(node, node.gpu_uuids()[0]) == pynvml.NVML_COMPUTEMODE_DEFAULT


@pytest.mark.parametrize(("args", "status"), [
    (["--bogus"], 2),
    (["-i", "0"], 2),
    (["-i", "0", "-c", "EXCLUSIVE_THREAD"], 2),
    (["-i", "0", "-c", "1"], 2),
    (["compute-policy", "-i", "0", "--set-timeslice", "4"], 2),
    (["compute-policy", "-i", "0", "-c", "DEFAULT"], 2),
    (["-i", "GPU-00000000-0000-0000-0000-000000000000", "-c", "DEFAULT"], 6),
    (["-i", "9", "-c", "DEFAULT"], 6),
])
def test_bad_arguments_exit_as_the_real_tool_does(make_node: NodeFactory, args: list[str],
                                                  status: int) -> None:
    """Unknown options exit 2 with the usage; an unknown device exits 6; nothing changes."""
    node = make_node("l40s")
    done = smi(node, *args)
    assert done.returncode == status, (done.stdout, done.stderr)
    if status == 2:
        assert "nvidia-smi -i <id> -c" in done.stderr
    assert all(g["compute_mode"] == "DEFAULT" and g["timeslice"] == 0
               for g in node.describe()["gpus"])


@pytest.mark.parametrize("value", [1, 2, 3, 0])
def test_timeslice_is_hardware_state(make_node: NodeFactory, value: int) -> None:
    """``compute-policy --set-timeslice N`` records N for that GPU only (by UUID or index)."""
    node = make_node("l40s")
    done = smi(node, "compute-policy", "-i", "2", "--set-timeslice", str(value))
    assert done.returncode == 0, done.stderr
    assert [g["timeslice"] for g in node.describe()["gpus"]] == [0, 0, value, 0]


def test_compute_mode_and_timeslice_survive_a_restart_and_not_a_driver_reload(
        tmp_path: Path) -> None:
    """A restarted simulated node keeps them (hardware state); a driver reload resets them."""
    state, proc = tmp_path / "state", tmp_path / "proc"
    node = SimulatedNode("l40s", state, proc)
    uuid = node.gpu_uuids()[3]
    assert smi(node, "-i", uuid, "-c", "EXCLUSIVE_PROCESS").returncode == 0
    assert smi(node, "compute-policy", "-i", uuid, "--set-timeslice", "3").returncode == 0
    node.close()
    node = SimulatedNode("l40s", state, proc)
    try:
        node.nvml.nvmlInit()
        assert mode_of(node, uuid) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        assert (gpu_state(node, 3)["compute_mode"], gpu_state(node, 3)["timeslice"]) == (
            "EXCLUSIVE_PROCESS", 3)
        node.reload_driver()
        assert mode_of(node, uuid) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert gpu_state(node, 3)["timeslice"] == 0
    finally:
        node.close()


def test_a_gpu_reset_restores_the_defaults_of_that_gpu_only(make_node: NodeFactory) -> None:
    """``nvidia-smi -r`` (the sim's reset) sets DEFAULT and time slice 0 on that GPU only."""
    node = make_node("l40s")
    for index in ("0", "1"):
        assert smi(node, "-i", index, "-c", "PROHIBITED").returncode == 0
        assert smi(node, "compute-policy", "-i", index, "--set-timeslice", "3").returncode == 0
    node.reset_gpu(node.gpu_uuids()[0])
    assert [(g["compute_mode"], g["timeslice"]) for g in node.describe()["gpus"]][:2] == [
        ("DEFAULT", 0), ("PROHIBITED", 3)]


def test_with_mig_on_the_mode_belongs_to_each_mig_device(make_node: NodeFactory) -> None:
    """With MIG on, the GPU's own compute mode cannot be set (exit 3) and time slicing is not
    supported; a MIG device's mode is its own (NVML: set through the MIG device handle)."""
    node = make_node("dgx-h100")
    handle = enable_mig(node, 0)
    gi = node.nvml.nvmlDeviceCreateGpuInstance(handle, 19)
    node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig = node.nvml.nvmlDeviceGetUUID(node.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    gpu = node.gpu_uuids()[0]
    assert smi(node, "-i", gpu, "-c", "EXCLUSIVE_PROCESS").returncode == 3
    assert smi(node, "compute-policy", "-i", gpu, "--set-timeslice", "1").returncode == 3
    assert smi(node, "-i", mig, "-c", "EXCLUSIVE_PROCESS").returncode == 0
    assert mode_of(node, mig) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert mode_of(node, gpu) == pynvml.NVML_COMPUTEMODE_DEFAULT
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.nvml.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_PROHIBITED)


@pytest.mark.parametrize(("skip", "times", "outcomes"), [
    (0, 1, [1, 0]),
    (1, 1, [0, 1, 0]),
    (0, 2, [1, 1, 0]),
])
def test_a_fault_fails_the_next_calls(make_node: NodeFactory, skip: int, times: int,
                                      outcomes: list[int]) -> None:
    """A fault on ``nvidia-smi`` fails the matching calls (after ``skip``, ``times`` times)
    with its message and changes nothing; later calls succeed."""
    node = make_node("l40s")
    node.add_fault("nvidia-smi", "Insufficient Permissions", skip=skip, times=times)
    results = []
    for _ in outcomes:
        done = smi(node, "compute-policy", "-i", "0", "--set-timeslice", "2")
        results.append(done.returncode)
        if done.returncode:
            assert "Insufficient Permissions" in done.stderr
    assert results == outcomes
    assert node.describe()["calls"]["nvidia-smi"] == len(outcomes)


def test_a_fault_limited_to_one_gpu_spares_the_others(make_node: NodeFactory) -> None:
    """A fault given a GPU fires only for calls on that GPU."""
    node = make_node("l40s")
    first, second = node.gpu_uuids()[:2]
    node.add_fault("nvidia-smi", "Unknown Error", gpu=second)
    assert smi(node, "-i", first, "-c", "PROHIBITED").returncode == 0
    assert smi(node, "-i", second, "-c", "PROHIBITED").returncode == 1
    assert mode_of(node, second) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_a_closed_node_is_no_driver(tmp_path: Path) -> None:
    """Once the node is closed, the tool says it cannot reach the driver (exit 9)."""
    node = SimulatedNode("l40s", tmp_path / "state", tmp_path / "proc")
    node.close()
    done = smi(node, "-i", "0", "-c", "DEFAULT")
    assert done.returncode == 9
    assert "couldn't communicate with the NVIDIA driver" in done.stderr
