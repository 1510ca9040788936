"""The taint schema: each fault's key, value and effect, scoping to MIG instances, and one
taint per key."""

from __future__ import annotations

import pytest

from agent.health.taints import (
    Fault,
    RecoveryAction,
    blocking_reasons,
    device_taints,
    label_value,
    taint_of,
)

D = "gpu.nodeagent.dev"


def xid(n: int, *, action: RecoveryAction | None = None, since: float = 1.0,
        gi: int | None = None, ci: int | None = None) -> Fault:
    return Fault("xid", f"XID {n}", since, value=str(n), gi_id=gi, ci_id=ci,
                 recovery_action=action)


@pytest.mark.parametrize(("fault", "no_execute", "key", "value", "effect"), [
    (xid(48), False, f"{D}/xid", "48", "NoSchedule"),
    (xid(31), False, f"{D}/xid", "31", "None"),
    (xid(13), True, f"{D}/xid", "13", "None"),
    (xid(79), False, f"{D}/xid", "79", "NoSchedule"),
    (xid(79), True, f"{D}/xid", "79", "NoExecute"),
    (xid(48), True, f"{D}/xid", "48", "NoSchedule"),
    # the driver's recovery action wins over the table
    (xid(31, action=RecoveryAction.GPU_RESET), False, f"{D}/xid", "31", "NoSchedule"),
    (xid(48, action=RecoveryAction.NONE), False, f"{D}/xid", "48", "None"),
    (xid(48, action=RecoveryAction.NODE_REBOOT), True, f"{D}/xid", "48", "NoExecute"),
    (xid(79, action=RecoveryAction.DRAIN_AND_RESET), True, f"{D}/xid", "79", "NoSchedule"),
    (xid(74, action=RecoveryAction.DRAIN_P2P), True, f"{D}/xid", "74", "NoSchedule"),
    (xid(48, action=RecoveryAction.SYSTEM_REBOOT), True, f"{D}/xid", "48", "NoExecute"),
    (xid(48, action=RecoveryAction.BUS_RESET), True, f"{D}/xid", "48", "NoSchedule"),
    (xid(48, action=RecoveryAction.RECOVER_IMEX_DOMAIN), True, f"{D}/xid", "48", "NoSchedule"),
    (Fault("gpu-lost", "lost", 1.0), False, f"{D}/gpu-lost", None, "NoSchedule"),
    (Fault("gpu-lost", "lost", 1.0), True, f"{D}/gpu-lost", None, "NoExecute"),
    (Fault("unmonitored", "no events", 1.0), True, f"{D}/unmonitored", None, "None"),
    (Fault("quarantined", "q", 1.0), True, f"{D}/quarantined", None, "NoSchedule"),
    (Fault("drain", "maintenance", 1.0, value="maintenance"), True, f"{D}/drain",
     "maintenance", "NoSchedule"),
    (Fault("fabric", "in progress", 1.0, value="in_progress"), True, f"{D}/fabric",
     "in_progress", "NoSchedule"),
    (Fault("fabric-health", "degraded", 1.0, value="degraded_bandwidth"), True,
     f"{D}/fabric-health", "degraded_bandwidth", "None"),
])
def test_each_fault_has_its_taint(fault: Fault, no_execute: bool, key: str,
                                  value: str | None, effect: str) -> None:
    taint = taint_of(fault, driver=D, no_execute=no_execute)
    assert (taint.key, taint.value, taint.effect) == (key, value, effect)
    assert taint.time_added == fault.since and taint.reason == fault.reason


def test_one_taint_per_key_the_heaviest_then_the_newest() -> None:
    faults = (xid(31, since=5.0), xid(48, since=2.0), xid(63, since=3.0))
    (taint,) = device_taints(faults, driver=D, no_execute=False)
    assert (taint.value, taint.effect) == ("63", "NoSchedule")
    (taint,) = device_taints((xid(31, since=1.0), xid(43, since=2.0)), driver=D,
                             no_execute=False)
    assert (taint.value, taint.effect) == ("43", "None")


def test_a_mig_scoped_fault_taints_only_its_instance() -> None:
    faults = (xid(48, gi=1, ci=0), Fault("unmonitored", "u", 1.0))
    def keys(instance: tuple[int, int | None] | None) -> list[tuple[str, str | None]]:
        return [(t.key, t.value) for t in device_taints(faults, driver=D, no_execute=False,
                                                       instance=instance)]
    assert keys(None) == [(f"{D}/unmonitored", None)]
    assert keys((1, 0)) == [(f"{D}/unmonitored", None), (f"{D}/xid", "48")]
    assert keys((1, None)) == [(f"{D}/unmonitored", None), (f"{D}/xid", "48")]
    assert keys((1, 1)) == [(f"{D}/unmonitored", None)]
    assert keys((2, 0)) == [(f"{D}/unmonitored", None)]
    gi_wide = (xid(48, gi=1),)
    assert device_taints(gi_wide, driver=D, no_execute=False, instance=(1, 3))
    assert not device_taints(gi_wide, driver=D, no_execute=False, instance=(2, 0))


def test_only_blocking_taints_give_reasons() -> None:
    taints = device_taints((xid(31), Fault("gpu-lost", "GPU is lost", 2.0)), driver=D,
                           no_execute=False)
    assert blocking_reasons(taints) == ("GPU is lost",)


@pytest.mark.parametrize(("text", "value"), [
    ("maintenance", "maintenance"),
    ("fan swap, ticket #123", "fan-swap-ticket-123"),
    ("  !!", ""),
    ("x" * 80, "x" * 63),
])
def test_label_values(text: str, value: str) -> None:
    assert label_value(text) == value
