"""From a ResourceClaim to the agent's claims API and back (agent/kubeplugin/claims.py): which
results are this node's, and what the agent and kubelet are told."""

from __future__ import annotations

from typing import Any

import pytest

from agent.kubeplugin.claims import (
    Allocated,
    ClaimError,
    KubeletClaim,
    KubeletDevice,
    agent_body,
    kubelet_devices,
    our_devices,
)
from tests.kubeplugin.conftest import DRIVER, NODE, resource_claim, result

CLAIM = KubeletClaim("ns", "uid-1", "c")


def claim_with(results: list[dict[str, Any]] | None, **meta: Any) -> dict[str, Any]:
    obj = resource_claim("c", "uid-1", results, namespace="ns")
    obj["metadata"].update(meta)
    return obj


@pytest.mark.parametrize(("results", "expected"), [
    ([result("gpu-0")], [Allocated("gpu-0", NODE, ("gpu",), False)]),
    # other drivers and other pools of this driver are not ours
    ([result("nic-0", driver="net.example.com"), result("gpu-1", pool="node-b"),
      result("gpu-2", "b")], [Allocated("gpu-2", NODE, ("b",), False)]),
    # order kept; subrequest names kept whole
    ([result("gpu-3", "x/big"), result("gpu-1", "y")],
     [Allocated("gpu-3", NODE, ("x/big",), False), Allocated("gpu-1", NODE, ("y",), False)]),
    # one device serving two requests is one device; exclusive when either request is
    ([result("gpu-4", "a", admin=True), result("gpu-4", "b")],
     [Allocated("gpu-4", NODE, ("a", "b"), False)]),
    ([result("gpu-4", "a", admin=True)], [Allocated("gpu-4", NODE, ("a",), True)]),
])
def test_only_this_drivers_results_in_this_nodes_pool_are_ours(
        results: list[dict[str, Any]], expected: list[Allocated]) -> None:
    """our_devices keeps this driver's results in this node's pool, in order, one per device."""
    assert our_devices(CLAIM, claim_with(results), driver=DRIVER, pool=NODE) == expected


@pytest.mark.parametrize(("obj", "reason"), [
    (claim_with([result("gpu-0")], uid="other"), "uid-mismatch"),
    (claim_with(None), "not-allocated"),
    (claim_with([]), "no-devices"),
    (claim_with([result("gpu-0", pool="node-b")]), "no-devices"),
    (claim_with([{"driver": DRIVER, "pool": NODE, "request": "r"}]), "bad-allocation"),
])
def test_claims_that_cannot_be_ours_say_why(obj: dict[str, Any], reason: str) -> None:
    """A recreated, unallocated or foreign claim is a ClaimError with a stable reason that
    names the claim."""
    with pytest.raises(ClaimError) as raised:
        our_devices(CLAIM, obj, driver=DRIVER, pool=NODE)
    assert raised.value.reason == reason and "uid-1" in str(raised.value)


def test_the_agent_gets_slice_names_request_names_metadata_and_the_stamp() -> None:
    """The agent's body names devices as the ResourceSlice does, keeps request names, marks
    admin access, carries namespace/name/resourceVersion, the only pod, and issued_at_ns."""
    obj = claim_with([], resourceVersion="42")
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": "trainer-0", "uid": "p"}]
    devices = [Allocated("gpu-1", NODE, ("main",), False),
               Allocated("gpu-2-mig-1g10gb-19-0", NODE, ("mon",), True),
               Allocated("gpu-3", NODE, ("r" * 64 + "/s",), False)]
    assert agent_body(obj, devices, 1234) == {
        "devices": [{"kind": "gpu", "device": "gpu-1", "name": "main"},
                    {"kind": "gpu", "device": "gpu-2-mig-1g10gb-19-0", "name": "mon",
                     "admin_access": True},
                    {"kind": "gpu", "device": "gpu-3"}],
        "metadata": {"namespace": "ns", "name": "c", "resource_version": "42",
                     "pod": "trainer-0"},
        "issued_at_ns": 1234}


def test_partitionable_devices_are_slices_to_make() -> None:
    """A device named in on_demand (a partitionable MIG placement) is sent as a slice to make
    at that placement; the others as existing devices."""
    devices = [Allocated("gpu-1-mig-1g10gb-19-2", NODE, ("s",), False),
               Allocated("gpu-2", NODE, ("g",), False)]
    body = agent_body(claim_with([]), devices, 1, on_demand={"gpu-1-mig-1g10gb-19-2"})
    assert body["devices"] == [
        {"kind": "slice", "device": "gpu-1-mig-1g10gb-19-2", "name": "s"},
        {"kind": "gpu", "device": "gpu-2", "name": "g"}]


def test_kubelet_gets_each_device_with_the_agents_cdi_names() -> None:
    """Kubelet's devices pair each allocated device with the CDI names the agent answered for
    it; a device the answer lacks is this claim's error."""
    devices = [Allocated("gpu-1", NODE, ("a", "b"), False)]
    answer = {"devices": [{"device_name": "gpu-1", "cdi_devices": ["k/claim=uid-1-gpu-1"]}]}
    assert kubelet_devices(CLAIM, devices, answer) == [
        KubeletDevice(("a", "b"), NODE, "gpu-1", ("k/claim=uid-1-gpu-1",))]
    with pytest.raises(ClaimError, match="no CDI device for gpu-1"):
        kubelet_devices(CLAIM, devices, {"devices": []})
