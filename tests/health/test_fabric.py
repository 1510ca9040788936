"""A GPU's NVLink fabric as faults and taints, as a table: registration not done or failed
blocks (``<driver>/fabric`` NoSchedule, value the state or status), a flagged health mask on a
registered fabric is informational (``<driver>/fabric-health``), no fabric or a healthy one is
nothing; a fault seen again keeps when it was first seen."""

from __future__ import annotations

import pytest

from agent.gpu.types import Fabric
from agent.health.fabric import fabric_faults
from agent.health.faults import decode_fault, encode_fault
from agent.health.taints import device_taints

D = "gpu.nodeagent.dev"
CLUSTER = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"
ZERO = "00000000-0000-0000-0000-000000000000"
COMPLETED, IN_PROGRESS, NOT_STARTED = 3, 2, 1


def fabric(state: int = COMPLETED, status: int = 0, *, uuid: str = CLUSTER,
           status_name: str = "NVML_SUCCESS", health: tuple[str, ...] = ()) -> Fabric:
    return Fabric(cluster_uuid=uuid, clique_id=7, state=state, status=status,
                  status_name=status_name, health_mask=0, health=health)


# (fabric as read, the GPU's taints as (key, value, effect))
TABLE = [
    (None, []),  # NOT_SUPPORTED: no fabric, no fault
    (fabric(), []),
    (fabric(uuid=ZERO), []),  # registered, in no multi-node domain (single-node NVSwitch)
    (fabric(NOT_STARTED, uuid=ZERO), [(f"{D}/fabric", "not_started", "NoSchedule")]),
    (fabric(IN_PROGRESS, uuid=ZERO), [(f"{D}/fabric", "in_progress", "NoSchedule")]),
    (fabric(9, uuid=ZERO), [(f"{D}/fabric", "unknown-9", "NoSchedule")]),
    (fabric(status=23, status_name="NVML_ERROR_INSUFFICIENT_RESOURCES", uuid=ZERO),
     [(f"{D}/fabric", "NVML_ERROR_INSUFFICIENT_RESOURCES", "NoSchedule")]),
    (fabric(health=("degraded_bandwidth",)),
     [(f"{D}/fabric-health", "degraded_bandwidth", "None")]),
    (fabric(health=("degraded_bandwidth", "route_unhealthy")),
     [(f"{D}/fabric-health", "degraded_bandwidth", "None")]),
    (fabric(IN_PROGRESS, uuid=ZERO, health=("route_unhealthy",)),
     [(f"{D}/fabric", "in_progress", "NoSchedule"),
      (f"{D}/fabric-health", "route_unhealthy", "None")]),
]


@pytest.mark.parametrize(("read", "expected"), TABLE,
                         ids=[f"{f.state_name}-{f.status_name}-{'.'.join(f.health)}-{f.clique}"
                              if f else "none" for f, _ in TABLE])
@pytest.mark.parametrize("no_execute", [False, True])
def test_a_fabric_becomes_its_taints(read: Fabric | None, expected: list[tuple[str, str, str]],
                                     no_execute: bool) -> None:
    """The effect never depends on ``--no-execute-taints``: a fabric fault evicts nobody."""
    faults = fabric_faults(read, seen={}, now=5.0)
    taints = device_taints(faults, driver=D, no_execute=no_execute)
    assert [(t.key, t.value, t.effect) for t in taints] == expected
    assert all(t.time_added == 5.0 and t.reason for t in taints)
    assert [decode_fault(encode_fault(f)) for f in faults] == list(faults)


def test_only_a_registered_fabric_without_an_error_has_a_clique_and_no_blocking_fault() -> None:
    """The published clique and the blocking fault are two sides of one rule."""
    for read, _ in TABLE:
        if read is None:
            continue
        blocking = any(t.blocking for t in device_taints(
            fabric_faults(read, seen={}, now=1.0), driver=D, no_execute=False))
        assert not (blocking and read.clique), read


def test_a_fault_seen_again_keeps_its_time_and_a_new_one_gets_now() -> None:
    seen = {("fabric", "in_progress"): 1.0}
    (again,) = fabric_faults(fabric(IN_PROGRESS, uuid=ZERO), seen=seen, now=9.0)
    assert again.since == 1.0
    (other,) = fabric_faults(fabric(NOT_STARTED, uuid=ZERO), seen=seen, now=9.0)
    assert other.since == 9.0


def test_the_reason_says_what_the_fabric_reports() -> None:
    (stuck,) = fabric_faults(fabric(IN_PROGRESS, uuid=ZERO), seen={}, now=1.0)
    assert stuck.reason == "NVLink fabric not registered: in_progress"
    (failed,) = fabric_faults(fabric(status=23, status_name="NVML_ERROR_INSUFFICIENT_RESOURCES"),
                              seen={}, now=1.0)
    assert "failed: NVML_ERROR_INSUFFICIENT_RESOURCES" in failed.reason
    (degraded,) = fabric_faults(fabric(health=("degraded_bandwidth", "route_unhealthy")),
                                seen={}, now=1.0)
    assert degraded.reason.endswith("degraded_bandwidth, route_unhealthy")
