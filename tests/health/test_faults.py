"""The health state file's records and the node's taint changes, as pure functions: what a
reboot clears, what a damaged record is, and which taints were added and removed."""

from __future__ import annotations

import pytest

from agent.health.faults import (
    GpuRecord,
    decode_fault,
    decode_state,
    encode_fault,
    encode_state,
    recovery_action,
)
from agent.health.report import changes, node_taints
from agent.health.taints import Fault, RecoveryAction

D = "gpu.nodeagent.dev"
XID = Fault("xid", "XID 94", 10.0, value="94", gi_id=2, ci_id=0,
            recovery_action=RecoveryAction.DRAIN_AND_RESET)
LOST = Fault("gpu-lost", "GPU is lost", 11.0)
FAIL_CLOSED = Fault("quarantined", "the health state was unreadable", 12.0)


@pytest.mark.parametrize("fault", [XID, LOST, FAIL_CLOSED, Fault("xid", "XID 13", 1, "13")])
def test_a_fault_round_trips(fault: Fault) -> None:
    assert decode_fault(encode_fault(fault)) == fault


@pytest.mark.parametrize("doc", [
    None, [], {"kind": "fire", "reason": "r", "since": 1}, {"kind": "xid", "since": 1},
    {"kind": "xid", "reason": "r", "since": "1"}, {"kind": "xid", "reason": "r", "since": True},
    {"kind": "xid", "reason": "r", "since": 1, "value": 48},
    {"kind": "xid", "reason": "r", "since": 1, "gi_id": "2"},
])
def test_a_damaged_fault_is_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        decode_fault(doc)


@pytest.mark.parametrize(("value", "action"), [
    (0, RecoveryAction.NONE), (2, RecoveryAction.NODE_REBOOT), (None, None), (99, None),
    (True, None), ("1", None)])
def test_recovery_action_of_a_stored_or_reported_value(value: object,
                                                       action: RecoveryAction | None) -> None:
    assert recovery_action(value) is action


@pytest.mark.parametrize(("boot", "kinds"), [
    ("boot-1", ["xid", "gpu-lost", "quarantined"]),  # a restart: everything
    ("boot-2", ["quarantined"]),  # a reboot reset the GPUs; the fail-closed mark stays
])
def test_a_reboot_clears_xids_and_lost_marks(boot: str, kinds: list[str]) -> None:
    payload = encode_state("boot-1", [GpuRecord("GPU-a", 0, 0, (XID, LOST, FAIL_CLOSED)),
                                      GpuRecord("GPU-b", 1, 1, (LOST,))])
    records = decode_state(payload, boot)
    assert [f.kind for f in records["GPU-a"].faults] == kinds
    assert ("GPU-b" in records) is (boot == "boot-1")


@pytest.mark.parametrize("payload", [None, {"gpus": []}, {"gpus": {"GPU-a": {"faults": 1}}},
                                     {"gpus": {"GPU-a": {"faults": [], "index": "0"}}}])
def test_a_damaged_state_is_refused(payload: object) -> None:
    with pytest.raises(ValueError):
        decode_state(payload, "boot")


def test_the_node_taints_and_their_changes() -> None:
    """GPU-wide taints and each MIG instance's own, one per identity; a reworded reason is
    no change, a new time is (the taint went and came back)."""
    before = node_taints([("GPU-a", 0, (LOST, XID)), ("GPU-b", 1, ())], driver=D,
                         no_execute=False)
    assert sorted((-1 if p.gpu_instance is None else p.gpu_instance, p.taint.key)
                  for p in before.values()) == [(-1, f"{D}/gpu-lost"), (2, f"{D}/xid")]
    reworded = node_taints([("GPU-a", 0, (Fault("gpu-lost", "other words", 11.0), XID))],
                           driver=D, no_execute=False)
    assert changes(before, reworded) == ([], [])
    later = node_taints([("GPU-a", 0, (Fault("gpu-lost", "lost", 20.0),))], driver=D,
                        no_execute=True)
    added, removed = changes(before, later)
    assert [(p.taint.key, p.taint.effect, p.taint.time_added) for p in added] == [
        (f"{D}/gpu-lost", "NoExecute", 20.0)]
    assert sorted(p.taint.key for p in removed) == [f"{D}/gpu-lost", f"{D}/xid"]
