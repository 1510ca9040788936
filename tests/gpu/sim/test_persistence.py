"""The simulated hardware survives a restart: same GPUs, instances and processes; one owner
per state directory; a corrupt state file is kept aside, never silently replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.durable import FileKind, decode_envelope, encode_envelope
from agent.errors import InvalidRequest, StateLocked
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.state import KIND, SCHEMA_VERSION, SimulatorStateError

from .conftest import create_gi, enable_mig


def _saved(path: Path) -> Any:
    """The state document as written (inside its durable envelope)."""
    return decode_envelope(path.read_bytes(), KIND).payload


def _snapshot(node: SimulatedNode) -> dict[str, Any]:
    """What NVML shows: GPU uuids, MIG modes, GIs with placements, MIG devices, processes."""
    nvml = node.nvml
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        mig = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except pynvml.NVMLError_NotFound:
                continue
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle,
                                                   nvml.nvmlDeviceGetGpuInstanceId(device))
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            mig.append((nvml.nvmlDeviceGetUUID(device), info.id, info.profileId,
                        info.placement.start, nvml.nvmlDeviceGetComputeInstanceId(device)))
        processes = sorted((p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId)
                           for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        gpus.append((nvml.nvmlDeviceGetUUID(handle), nvml.nvmlDeviceGetMigMode(handle), mig,
                     processes))
    return {"gpus": gpus, "boot_id": node.boot_id}


def _populate(node: SimulatedNode) -> None:
    handle = enable_mig(node, 2)
    for profile_id, at in ((9, (4, 4)), (14, (0, 2)), (19, (2, 1))):
        gi = create_gi(node, handle, profile_id, at)
        node.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    create_gi(node, handle, 19, (3, 1))  # a GI without CI survives too
    mig = node.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 1)
    node.add_process(node.nvml.nvmlDeviceGetUUID(mig), used_memory_mib=2048)
    node.add_process(node.gpu_uuids()[0], pid=4242)


def test_reopened_node_has_the_same_hardware(tmp_path: Path) -> None:
    """Close and reopen on the same directory: identical GPU and MIG UUIDs, instances (ids,
    placements), processes, boot id; GPU UUIDs differ between two separate nodes."""
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    node.nvml.nvmlInit()
    _populate(node)
    before = _snapshot(node)
    node.close()
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as again:
        again.nvml.nvmlInit()
        assert _snapshot(again) == before
        handle = again.nvml.nvmlDeviceGetHandleByIndex(2)
        gpu_instances = (pynvml.c_nvmlGpuInstance_t * 7)()
        count = pynvml.c_uint(7)
        again.nvml.nvmlDeviceGetGpuInstances(handle, 19, gpu_instances, pynvml.byref(count))
        assert count.value == 2
    with SimulatedNode("dgx-h100", tmp_path / "other", tmp_path / "proc2") as other:
        assert set(other.gpu_uuids()).isdisjoint(node.gpu_uuids())


def test_state_file_is_written_before_the_call_returns(tmp_path: Path) -> None:
    """After a create returns, hardware.json already holds the new GI (durable first)."""
    with SimulatedNode("dgx-a100", tmp_path / "state", tmp_path / "proc") as node:
        node.nvml.nvmlInit()
        create_gi(node, enable_mig(node), 9, (0, 4))
        saved = _saved(tmp_path / "state/sim/hardware.json")
        assert saved["schema_version"] == SCHEMA_VERSION
        assert saved["gpus"][0]["gpu_instances"][0]["profile_id"] == 9
        assert saved["gpus"][0]["mig_current"] == 1


def test_second_node_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    """While one SimulatedNode holds a state directory another gets StateLocked."""
    with (SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc"),
          pytest.raises(StateLocked)):
        SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")


def test_reopening_with_another_preset_is_refused(tmp_path: Path) -> None:
    """A directory holding a dgx-h100 node refuses dgx-a100 with InvalidRequest naming both."""
    SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc").close()
    with pytest.raises(InvalidRequest) as excinfo:
        SimulatedNode("dgx-a100", tmp_path / "state", tmp_path / "proc")
    assert "dgx-h100" in excinfo.value.detail
    assert "dgx-a100" in excinfo.value.detail
    SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc").close()  # lock released


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"schema_version": 1}',
                                     b'{"schema_version": 1, "preset": "dgx-h100", "seed": "x",'
                                     b' "boot_id": "b", "gpus": [], "processes": []}'])
def test_corrupt_state_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    """An unparseable or impossible state file is moved aside and reported, not replaced."""
    state_file = tmp_path / "state/sim/hardware.json"
    SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc").close()
    state_file.write_bytes(content)
    with pytest.raises(SimulatorStateError) as excinfo:
        SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    kept = list(state_file.parent.glob("hardware.json.corrupt-*"))
    assert len(kept) == 1
    assert kept[0].read_bytes() == content
    assert not state_file.exists()
    assert kept[0].name in excinfo.value.detail


def test_newer_schema_is_read(tmp_path: Path) -> None:
    """A state file from a newer simulator (higher version, unknown fields) is read, not
    refused: going back a version keeps the node."""
    state_file = tmp_path / "state/sim/hardware.json"
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    uuids = node.gpu_uuids()
    node.close()
    data = _saved(state_file)
    data["schema_version"] = SCHEMA_VERSION + 1
    data["future"] = {"x": 1}
    newer = FileKind(KIND.format, SCHEMA_VERSION + 1)
    state_file.write_bytes(encode_envelope(newer, json.dumps(data).encode()))
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as again:
        assert again.gpu_uuids() == uuids
    assert not list(state_file.parent.glob("hardware.json.corrupt-*"))


def test_state_directory_where_the_file_belongs_is_kept_aside(tmp_path: Path) -> None:
    """A directory at hardware.json is the documented unreadable case: kept aside, reported
    as SimulatorStateError naming where it went (never a traceback of another kind)."""
    state_file = tmp_path / "state/sim/hardware.json"
    SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc").close()
    state_file.unlink()
    (state_file / "inner").mkdir(parents=True)
    with pytest.raises(SimulatorStateError) as excinfo:
        SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    kept = list(state_file.parent.glob("hardware.json.corrupt-*"))
    assert len(kept) == 1 and (kept[0] / "inner").is_dir()
    assert "directory" in excinfo.value.detail and kept[0].name in excinfo.value.detail
    SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc").close()  # starts fresh


def test_unknown_fields_are_tolerated(tmp_path: Path) -> None:
    """Fields a newer writer added (same schema) are ignored on load: the node comes back as
    it was saved (a lost GPU included), and nothing is kept aside."""
    state_file = tmp_path / "state/sim/hardware.json"
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as node:
        node.inject_xid(node.gpu_uuids()[3], 79)
        saved = node.describe()
    data = _saved(state_file)
    data["future"] = {"x": 1}
    data["gpus"][0]["also_future"] = True
    state_file.write_bytes(encode_envelope(KIND, json.dumps(data).encode()))
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as again:
        assert again.describe() == saved
    assert not list(state_file.parent.glob("hardware.json.corrupt-*"))


def test_lost_gpu_stays_lost_across_restart(tmp_path: Path) -> None:
    """XID 79 marks a GPU lost durably; only a reset brings it back."""
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    uuid = node.gpu_uuids()[5]
    node.inject_xid(uuid, 79)
    node.close()
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as again:
        again.nvml.nvmlInit()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            again.nvml.nvmlDeviceGetHandleByIndex(5)
        again.reset_gpu(uuid)
        again.nvml.nvmlDeviceGetHandleByIndex(5)


def test_closed_node_refuses_changes(tmp_path: Path) -> None:
    """After close() the state can no longer change (another owner may hold it)."""
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    node.close()
    with pytest.raises(SimulatorStateError):
        node.add_process(node.gpu_uuids()[0])


def test_mig_minors_file_format(tmp_path: Path) -> None:
    """mig-minors lists config/monitor, then per GPU 15 GIs each followed by 8 CIs."""
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc"):
        lines = (tmp_path / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    entries = {minor: name for name, minor in (line.split(" ") for line in lines)}
    assert entries["21"] == "gpu0/gi2/access"
    assert entries["22"] == "gpu0/gi2/ci0/access"
    assert entries[str(3 + 135)] == "gpu1/gi0/access"
    assert entries[str(3 + 7 * 135 + 14 * 9 + 1 + 7)] == "gpu7/gi14/ci7/access"
    assert len(lines) == 2 + 8 * 15 * 9


def test_proc_devices_and_boot_id(tmp_path: Path) -> None:
    """/proc/devices has the NVIDIA majors; boot_id holds the node's boot id."""
    with SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc") as node:
        text = (tmp_path / "proc/devices").read_text()
        boot_id = (tmp_path / "proc/sys/kernel/random/boot_id").read_text().strip()
        assert boot_id == node.boot_id
    char, block = text.split("\n\n")
    assert char.startswith("Character devices:\n")
    assert block.startswith("Block devices:\n")
    majors = {line.split()[1]: int(line.split()[0]) for line in char.splitlines()[1:]}
    assert majors["nvidia-frontend"] == 195
    assert majors["nvidia-caps"] == 511
    assert "nvidia-uvm" in majors
    assert "nvidia-nvswitch" in majors
    numbers = [int(line.split()[0]) for line in char.splitlines()[1:]]
    assert numbers == sorted(numbers)
