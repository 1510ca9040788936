"""The CLI's table cells as pure functions of the agent's answers (issue 23): what AVAILABLE
says of a free, held, shared, MIG or tainted GPU; how a taint, a sharing and a share read."""

from __future__ import annotations

from typing import Any

import pytest

from agent.cli.claims import share_text, sharing_text
from agent.cli.tables import available_text, holders_text, taint_lines, taint_text

FREE = {"reasons": [], "holders": [], "available": True}


def gpu(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"index": 0, "availability": FREE, "mig_devices": [], "holds": [],
                            "shares": None, "taints": []}
    return {**base, **fields}


def mig(gi: int, available: bool, taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"profile": "3g.40gb", "gi_id": gi, "availability": {"available": available},
            "taints": taints or []}


SHARES = {"capacity_mib": 45056, "left_mib": 24576, "holders": [
    {"claim": "a", "memory_mib": 10240}, {"claim": "b", "memory_mib": 10240}]}
XID_48 = {"key": "gpu.nodeagent.dev/xid", "value": "48", "effect": "NoSchedule",
          "time_added": "2026-12-02T16:40:01Z", "reason": "XID 48: Double Bit ECC Error"}


@pytest.mark.parametrize(("case", "answer", "shown"), [
    ("free", gpu(), "ok"),
    ("held whole", gpu(availability={**FREE, "holders": ["c"], "available": False}),
     "NO: held"),
    ("blocking reason first", gpu(availability={**FREE, "reasons": ["XID 48: Double Bit ECC "
                                                                     "Error"],
                                                "holders": ["c"]}),
     "NO: XID 48: Double Bit ECC Error"),
    ("shares", gpu(shares=SHARES, availability={**FREE, "holders": ["a", "b"]}),
     "shares: 24576 of 45056 MiB left"),
    ("shares full", gpu(shares={**SHARES, "left_mib": 0}), "NO: shares take all 45056 MiB"),
    ("whole under MPS", gpu(shares={"capacity_mib": 45056, "left_mib": 0,
                                    "holders": [{"claim": "m", "memory_mib": None}]}),
     "NO: held"),
    ("MIG, one free", gpu(mig_devices=[mig(1, False), mig(2, True)]), "1 of 2 MIG devices"),
    ("MIG, none free", gpu(mig_devices=[mig(1, False)]), "NO: all 1 MIG devices held"),
])
def test_available(case: str, answer: dict[str, Any], shown: str) -> None:
    assert available_text(answer) == shown, case


def test_held_by_names_each_share_and_states() -> None:
    holds = [{"claim": "a", "device": "whole GPU", "state": "prepared", "kind": "share"},
             {"claim": "b", "device": "whole GPU", "state": "reserved", "kind": "share"},
             {"claim": "mon", "device": "whole GPU", "state": "prepared", "kind": "admin"}]
    assert holders_text(gpu(holds=holds, shares=SHARES)) == (
        "a (share 10240 MiB), b (share 10240 MiB, reserved), mon (whole GPU, admin)")


@pytest.mark.parametrize(("taint", "shown"), [
    (XID_48, "gpu.nodeagent.dev/xid=48:NoSchedule"),
    ({"key": "gpu.nodeagent.dev/gpu-lost", "value": None, "effect": "NoExecute"},
     "gpu.nodeagent.dev/gpu-lost:NoExecute"),
])
def test_taint_text_is_how_a_toleration_names_it(taint: dict[str, Any], shown: str) -> None:
    assert taint_text(taint) == shown


def test_a_gpus_taint_is_listed_once_and_a_mig_instances_own_apart() -> None:
    own = {**XID_48, "value": "94", "reason": "XID 94 (GPU instance 2)"}
    answer = gpu(taints=[XID_48], mig_devices=[mig(1, False, [XID_48]),
                                               mig(2, False, [XID_48, own])])
    assert taint_lines([answer]) == [
        "GPU 0  gpu.nodeagent.dev/xid=48:NoSchedule  since 2026-12-02T16:40:01Z: XID 48: "
        "Double Bit ECC Error",
        "GPU 0 3g.40gb gi 2  gpu.nodeagent.dev/xid=94:NoSchedule  since 2026-12-02T16:40:01Z: "
        "XID 94 (GPU instance 2)"]


@pytest.mark.parametrize(("device", "sharing", "share"), [
    ({}, "-", "-"),
    ({"sharing": {"strategy": "MPS", "thread_percentage": 22, "pinned_limit_mib": 10240},
      "share": {"memory_mib": 10240, "share_id": "id-a"}}, "MPS 22% 10240 MiB", "10240 MiB id-a"),
    ({"sharing": {"strategy": "MPS", "thread_percentage": None, "pinned_limit_mib": None}},
     "MPS", "-"),
    ({"sharing": {"strategy": "TimeSlicing", "interval": "Short"}}, "TimeSlicing Short", "-"),
])
def test_sharing_and_share_cells(device: dict[str, Any], sharing: str, share: str) -> None:
    assert (sharing_text(device), share_text(device)) == (sharing, share)
