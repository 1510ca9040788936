"""Injected faults and latencies: which call fails, how often, on which GPU, and that a
faulted call changes nothing; CRASH kills the process at that call with the state intact."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pynvml
import pytest

from agent.durable import decode_envelope
from agent.errors import InvalidRequest
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.state import KIND

from .conftest import create_gi, enable_mig, nvml_code


def test_skip_and_times(h100: SimulatedNode) -> None:
    """skip=2, times=2: calls 3 and 4 fail, 1, 2 and 5 succeed; describe counts it all."""
    h100.add_fault("nvmlDeviceGetCount", "NVML_ERROR_UNKNOWN", skip=2, times=2)
    outcomes = []
    for _ in range(5):
        try:
            h100.nvml.nvmlDeviceGetCount()
            outcomes.append("ok")
        except pynvml.NVMLError_Unknown:
            outcomes.append("fail")
    assert outcomes == ["ok", "ok", "fail", "fail", "ok"]
    described = h100.describe()
    assert described["faults"][0]["remaining"] == 0
    assert described["faults"][0]["skipped"] == 2
    assert described["calls"]["nvmlDeviceGetCount"] == 5


def test_error_name_without_prefix_is_accepted(h100: SimulatedNode) -> None:
    """``IN_USE`` means NVML_ERROR_IN_USE."""
    fault = h100.add_fault("nvmlDeviceGetCount", "IN_USE")
    assert fault["error"] == "NVML_ERROR_IN_USE"
    with pytest.raises(pynvml.NVMLError_InUse):
        h100.nvml.nvmlDeviceGetCount()


def test_gpu_filter_matches_handles_of_that_gpu(h100: SimulatedNode) -> None:
    """A fault for GPU 1 fires on calls with GPU 1's handles (GPU, GI, lookup by index), not
    on GPU 0's."""
    nvml = h100.nvml
    target = h100.gpu_uuids()[1]
    h100.add_fault("nvmlDeviceGetUUID", "NVML_ERROR_GPU_IS_LOST", gpu=target, times=1)
    nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1))
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1)) == target
    h100.add_fault("nvmlDeviceGetHandleByIndex", "NVML_ERROR_UNKNOWN", gpu=target)
    nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetHandleByIndex(1)
    gi = create_gi(h100, enable_mig(h100, 1), 0)
    h100.add_fault("nvmlGpuInstanceDestroy", "NVML_ERROR_IN_USE", gpu=target)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gi)
    nvml.nvmlGpuInstanceDestroy(gi)


def test_faulted_call_changes_nothing(h100: SimulatedNode) -> None:
    """A create that is made to fail leaves no GPU instance behind."""
    handle = enable_mig(h100)
    h100.add_fault("nvmlDeviceCreateGpuInstanceWithPlacement", "INSUFFICIENT_RESOURCES")
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create_gi(h100, handle, 0, (0, 8))
    assert h100.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 0) == 1
    create_gi(h100, handle, 0, (0, 8))


def test_clear_faults(h100: SimulatedNode) -> None:
    """clear_faults drops every pending fault."""
    h100.add_fault("nvmlDeviceGetCount", "NVML_ERROR_UNKNOWN", times=10)
    h100.clear_faults()
    assert h100.nvml.nvmlDeviceGetCount() == 8
    assert h100.describe()["faults"] == []


@pytest.mark.parametrize(("function", "error", "gpu"), [
    ("nvmlDeviceFrobnicate", "NVML_ERROR_UNKNOWN", None),
    ("nvmlStructToFriendlyObject", "NVML_ERROR_UNKNOWN", None),
    ("nvmlDeviceGetCount", "NVML_ERROR_NOPE", None),
    ("nvmlDeviceGetCount", "NVML_ERROR_UNKNOWN", "GPU-not-here"),
])
def test_bad_fault_requests_are_invalid(h100: SimulatedNode, function: str, error: str,
                                        gpu: str | None) -> None:
    """Unknown function, unknown error name or unknown GPU is an InvalidRequest."""
    with pytest.raises(InvalidRequest):
        h100.add_fault(function, error, gpu=gpu)


def test_fault_on_an_unimplemented_function(h100: SimulatedNode) -> None:
    """Any pynvml NVML function can be faulted; unimplemented ones otherwise answer
    FUNCTION_NOT_FOUND like a driver without the symbol."""
    handle = h100.nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        h100.nvml.nvmlDeviceGetFanSpeed(handle)
    h100.add_fault("nvmlDeviceGetFanSpeed", "NVML_ERROR_NOT_SUPPORTED")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        h100.nvml.nvmlDeviceGetFanSpeed(handle)
    assert h100.describe()["calls"]["nvmlDeviceGetFanSpeed"] == 2


def test_latency_sleeps_at_least_the_configured_time(h100: SimulatedNode) -> None:
    """A 50 ms latency on a function makes each of its calls take at least that long."""
    h100.set_latency({"nvmlDeviceGetCount": 0.05})
    started = time.monotonic()
    h100.nvml.nvmlDeviceGetCount()
    assert time.monotonic() - started >= 0.05
    assert h100.describe()["latencies"] == {"nvmlDeviceGetCount": 0.05}
    h100.set_latency({})
    assert h100.describe()["latencies"] == {}


@pytest.mark.parametrize("table", [{"nvmlNope": 1.0}, {"nvmlDeviceGetCount": -1},
                                   {"nvmlDeviceGetCount": 31}, {"nvmlDeviceGetCount": True},
                                   {"nvmlDeviceGetCount": float("nan")}])
def test_bad_latency_tables_are_invalid(h100: SimulatedNode, table: dict[str, float]) -> None:
    """Unknown functions and latencies outside 0-30 s are refused; the old table stays."""
    h100.set_latency({"nvmlDeviceGetCount": 0.0})
    with pytest.raises(InvalidRequest):
        h100.set_latency(table)
    assert h100.describe()["latencies"] == {"nvmlDeviceGetCount": 0.0}


def test_crash_fault_kills_the_process_before_the_effect(tmp_path: Path) -> None:
    """A CRASH fault SIGKILLs the process at the call; the state file is intact and the
    crashed call's effect (a GI) is absent while earlier ones persist."""
    script = textwrap.dedent(f"""
        import ctypes, pynvml
        from pathlib import Path
        from agent.gpu.sim.node import SimulatedNode
        node = SimulatedNode("dgx-h100", Path({str(tmp_path / "state")!r}),
                             Path({str(tmp_path / "proc")!r}))
        nvml = node.nvml
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        nvml.nvmlDeviceSetMigMode(handle, 1)
        node.add_fault("nvmlDeviceCreateGpuInstanceWithPlacement", "CRASH", skip=1)
        for start in (0, 4):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, 9, pynvml.c_nvmlGpuInstancePlacement_t(start, 4))
        print("not reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=False, cwd=Path(__file__).parents[3])
    assert result.returncode == -9, result.stderr
    assert "not reached" not in result.stdout
    saved = decode_envelope((tmp_path / "state/sim/hardware.json").read_bytes(), KIND).payload
    assert [gi["start"] for gi in saved["gpus"][0]["gpu_instances"]] == [0]
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as node:
        node.nvml.nvmlInit()
        handle = node.nvml.nvmlDeviceGetHandleByIndex(0)
        assert node.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 9) == 1


def test_uninitialized_calls_are_counted_and_refused(h100: SimulatedNode) -> None:
    """Before nvmlInit (or after the last nvmlShutdown) calls raise UNINITIALIZED."""
    h100.nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError) as excinfo:
        h100.nvml.nvmlDeviceGetCount()
    assert nvml_code(excinfo) == pynvml.NVML_ERROR_UNINITIALIZED
    assert h100.describe()["calls"]["nvmlDeviceGetCount"] == 1
