"""NVML's recovery action on the simulator: field 230 (and the deprecated 226/227) per GPU as
the driver answers it, what an injected XID leaves it at, a reset and a driver reload clearing
it, the event a change posts, and the R535 preset answering NOT_SUPPORTED."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from agent.errors import InvalidRequest
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.recovery_action import (
    DRAIN_AND_RESET,
    DRAIN_P2P,
    GPU_RESET,
    NODE_REBOOT,
    NONE,
    action_after,
)

from .conftest import NodeFactory, create_gi, enable_mig

RECOVERY = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
RESET_STATUS = pynvml.NVML_FI_DEV_RESET_STATUS
DRAIN_AND_RESET_STATUS = pynvml.NVML_FI_DEV_DRAIN_AND_RESET_STATUS


def fields(node: SimulatedNode, index: int, *ids: int) -> list[Any]:
    handle = node.nvml.nvmlDeviceGetHandleByIndex(index)
    return list(node.nvml.nvmlDeviceGetFieldValues(handle, list(ids)))


def action(node: SimulatedNode, index: int) -> int:
    value = fields(node, index, RECOVERY)[0]
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    assert value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    return int(value.value.uiVal)


@pytest.mark.parametrize(("xid", "nvlink", "before", "after"), [
    (48, True, NONE, GPU_RESET), (63, True, NONE, GPU_RESET), (64, True, NONE, GPU_RESET),
    (95, True, NONE, GPU_RESET), (119, True, NONE, GPU_RESET), (120, True, NONE, GPU_RESET),
    (79, True, NONE, NODE_REBOOT), (74, True, NONE, DRAIN_P2P), (74, False, NONE, NONE),
    # Application XIDs, contained ECC errors and unknown XIDs leave the action as it is.
    *((x, True, NONE, NONE) for x in (13, 31, 43, 45, 68, 109, 94, 154, 999)),
    (31, True, GPU_RESET, GPU_RESET),
    # It only goes up: the heavier of what the GPU needed and what the XID needs.
    (48, True, NODE_REBOOT, NODE_REBOOT), (79, True, GPU_RESET, NODE_REBOOT),
    (48, True, DRAIN_P2P, GPU_RESET), (74, True, DRAIN_AND_RESET, DRAIN_AND_RESET),
])
def test_the_action_an_xid_leaves(xid: int, nvlink: bool, before: int, after: int) -> None:
    assert action_after(xid, before, nvlink=nvlink) == after


def test_a_fresh_gpu_needs_nothing_and_an_xid_sets_its_gpu_only(h100: SimulatedNode) -> None:
    """Field 230 answers NONE as an unsigned int; XID 48 sets GPU_RESET on its GPU alone,
    the deprecated 226/227 say "reset required", not "drain"; a MIG device's XID sets its
    GPU's action."""
    assert [action(h100, i) for i in range(8)] == [NONE] * 8
    reply = h100.inject_xid(h100.gpu_uuids()[2], 48)
    assert reply["recovery_action"] == "reset"
    assert [action(h100, i) for i in range(8)] == [NONE, NONE, GPU_RESET] + [NONE] * 5
    reset, drain = fields(h100, 2, RESET_STATUS, DRAIN_AND_RESET_STATUS)
    assert (reset.nvmlReturn, int(reset.value.uiVal)) == (pynvml.NVML_SUCCESS, 1)
    assert (drain.nvmlReturn, int(drain.value.uiVal)) == (pynvml.NVML_SUCCESS, 0)
    handle = enable_mig(h100, 5)
    gi = create_gi(h100, handle, 19)
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    h100.inject_xid(_text(h100.nvml.nvmlDeviceGetUUID(mig)), 95)
    assert action(h100, 5) == GPU_RESET
    # A MIG device handle answers no GPU-wide field, as the real driver's.
    assert h100.nvml.nvmlDeviceGetFieldValues(mig, [RECOVERY])[0].nvmlReturn == \
        pynvml.NVML_ERROR_NOT_SUPPORTED


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_an_explicit_action_overrides_the_table(h100: SimulatedNode) -> None:
    """The named action is set exactly, lower or higher than the table's, ``none`` too."""
    uuid = h100.gpu_uuids()[1]
    h100.inject_xid(uuid, 13, "drain-and-reset")
    assert action(h100, 1) == DRAIN_AND_RESET
    reset, drain = fields(h100, 1, RESET_STATUS, DRAIN_AND_RESET_STATUS)
    assert (int(reset.value.uiVal), int(drain.value.uiVal)) == (1, 1)
    h100.inject_xid(uuid, 48, "none")
    assert action(h100, 1) == NONE
    with pytest.raises(InvalidRequest) as excinfo:
        h100.inject_xid(uuid, 48, "reformat")
    assert excinfo.value.errors[0]["field"] == "recovery_action"
    assert action(h100, 1) == NONE  # refused: nothing changed


def test_a_reset_and_a_driver_reload_set_none(h100: SimulatedNode) -> None:
    """``nvidia-smi -r`` clears its GPU's action (and a lost GPU's), a driver reload every
    GPU's; what the driver keeps survives a restart of the simulator until then."""
    uuids = h100.gpu_uuids()
    h100.inject_xid(uuids[0], 48)
    h100.inject_xid(uuids[1], 79)
    h100.inject_xid(uuids[2], 74)
    h100.reset_gpu(uuids[1])
    assert [action(h100, i) for i in range(3)] == [GPU_RESET, NONE, DRAIN_P2P]
    state = h100.state_dir
    h100.close()
    again = SimulatedNode("dgx-h100", state, h100.proc_root)
    try:
        again.nvml.nvmlInit()
        assert [action(again, i) for i in range(3)] == [GPU_RESET, NONE, DRAIN_P2P]
        assert [g["recovery_action"] for g in again.describe()["gpus"][:3]] == \
            ["reset", "none", "drain-p2p"]
        again.reload_driver()
        assert [action(again, i) for i in range(8)] == [NONE] * 8
    finally:
        again.close()


def test_a_lost_gpu_answers_no_field(h100: SimulatedNode) -> None:
    """After XID 79 the driver holds NODE_REBOOT, but the GPU answers no NVML call."""
    h100.inject_xid(h100.gpu_uuids()[4], 79)
    assert h100.hardware.gpu(4).recovery_action == NODE_REBOOT
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fields(h100, 4, RECOVERY)


def test_a_change_posts_the_recovery_action_event(h100: SimulatedNode) -> None:
    """An event set registered for ``nvmlEventTypeGpuRecoveryAction`` gets one event per
    change, its data the new action, after the XID; no change, no event; an XID set
    gets the XID only (no XID 154 on the XID stream)."""
    nvml = h100.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    both, xids = nvml.nvmlEventSetCreate(), nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError
                                  | pynvml.nvmlEventTypeGpuRecoveryAction, both)
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, xids)
    uuid = h100.gpu_uuids()[3]
    h100.inject_xid(uuid, 48)
    h100.inject_xid(uuid, 63)  # GPU_RESET already: no change
    got = [(int(e.eventType), int(e.eventData)) for e in _drain(h100, both)]
    assert got == [(pynvml.nvmlEventTypeXidCriticalError, 48),
                   (pynvml.nvmlEventTypeGpuRecoveryAction, GPU_RESET),
                   (pynvml.nvmlEventTypeXidCriticalError, 63)]
    assert [int(e.eventData) for e in _drain(h100, xids)] == [48, 63]


def _drain(node: SimulatedNode, event_set: Any) -> list[Any]:
    found = []
    while True:
        try:
            found.append(node.nvml.nvmlEventSetWait_v2(event_set, 0))
        except pynvml.NVMLError_Timeout:
            return found


def test_the_r535_driver_answers_not_supported(make_node: NodeFactory) -> None:
    """dgx-a100-r535: the same node on driver 535, whose NVML has no recovery action: the
    three fields answer NOT_SUPPORTED (the call itself succeeds), an XID sets nothing, the
    event type is not offered, and an explicit action is refused."""
    node = make_node("dgx-a100-r535")
    nvml = node.nvml
    assert nvml.nvmlSystemGetDriverVersion() == "535.247.01"
    assert nvml.nvmlSystemGetNVMLVersion() == "12.535.247.01"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 12020
    uuid = node.gpu_uuids()[0]
    assert node.inject_xid(uuid, 48)["recovery_action"] is None
    answers = fields(node, 0, RECOVERY, RESET_STATUS, DRAIN_AND_RESET_STATUS,
                     pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER)
    assert [int(v.nvmlReturn) for v in answers] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 3 + [
        pynvml.NVML_SUCCESS]
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert not nvml.nvmlDeviceGetSupportedEventTypes(handle) & \
        pynvml.nvmlEventTypeGpuRecoveryAction
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeGpuRecoveryAction,
                                      nvml.nvmlEventSetCreate())
    with pytest.raises(InvalidRequest) as excinfo:
        node.inject_xid(uuid, 48, "reset")
    assert "535.247.01" in excinfo.value.detail
    assert node.describe()["gpus"][0]["recovery_action"] is None
    assert node.describe()["driver_version"] == "535.247.01"


def test_registration_fails_on_the_gpu_a_fault_names_by_index(h100: SimulatedNode) -> None:
    """``nvmlDeviceRegisterEvents`` faults like any call, limited to a GPU named by index
    (as ``GPU_AGENT_SIM_FAULTS`` names one before the UUIDs are known)."""
    fault = h100.add_fault("nvmlDeviceRegisterEvents", "NOT_SUPPORTED", "2", times=1)
    assert fault["gpu"] == h100.gpu_uuids()[2]
    nvml = h100.nvml
    event_set = nvml.nvmlEventSetCreate()
    for index in (0, 1, 3):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index),
                                      pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(2),
                                      pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(InvalidRequest):
        h100.add_fault("nvmlDeviceRegisterEvents", "NOT_SUPPORTED", "8")
