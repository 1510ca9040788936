"""From a ResourceClaim to the agent's claims API and back (agent/kubeplugin/claims.py): which
results are this node's, and what the agent and kubelet are told."""

from __future__ import annotations

from collections.abc import Callable
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
    with_configs,
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
    assert agent_body(CLAIM, obj, devices, 1234) == {
        "devices": [{"kind": "gpu", "device": "gpu-1", "name": "main"},
                    {"kind": "gpu", "device": "gpu-2-mig-1g10gb-19-0", "name": "mon",
                     "admin_access": True},
                    {"kind": "gpu", "device": "gpu-3"}],
        "metadata": {"namespace": "ns", "name": "c", "resource_version": "42",
                     "pod": "trainer-0"},
        "issued_at_ns": 1234, "device_names": "resourceslice"}


def test_partitionable_devices_are_slices_to_make() -> None:
    """A device named in on_demand (a partitionable MIG placement) is sent as a slice to make
    at that placement; the others as existing devices."""
    devices = [Allocated("gpu-1-mig-1g10gb-19-2", NODE, ("s",), False),
               Allocated("gpu-2", NODE, ("g",), False)]
    body = agent_body(CLAIM, claim_with([]), devices, 1, on_demand={"gpu-1-mig-1g10gb-19-2"})
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


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """A change setting the field at ``path`` (keys and list indices) of a ResourceClaim."""
    def change(obj: Any) -> None:
        for step in path[:-1]:
            obj = obj[step]
        obj[path[-1]] = value
    return change


_DEVICES = ("status", "allocation", "devices")
_RESULT = (*_DEVICES, "results", 0)
_OURS = {"opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": "resource.nodeagent.dev/v1beta1", "kind": "GpuConfig"}}}
_RESULTS = "status.allocation.devices.results"

#: ResourceClaims (allocated one result, gpu-1, of this driver and node) changed to a wrong
#: shape, and the field each one's error must name.
WRONG_SHAPES: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (_set((*_DEVICES, "results"), {"gpu": 1}), f"{_RESULTS}: want an array, got object"),
    (_set(("status", "allocation"), "yes"), "status.allocation: want an object, got string"),
    (_set(("status", "allocation"), [1]), "status.allocation: want an object, got array"),
    (_set(_DEVICES, []), "status.allocation.devices: want an object, got array"),
    (_set((*_DEVICES, "results"), ["gpu-1"]), f"{_RESULTS}[0]: want an object, got string"),
    (_set((*_RESULT, "device"), 7), f"{_RESULTS}[0].device: want a string, got number"),
    (_set((*_RESULT, "request"), ["gpu"]), f"{_RESULTS}[0].request: want a string, got array"),
    (_set((*_RESULT, "adminAccess"), "yes"), f"{_RESULTS}[0].adminAccess: want a boolean"),
    (_set((*_RESULT, "shareID"), 5), f"{_RESULTS}[0].shareID: want a string, got number"),
    (_set((*_RESULT, "consumedCapacity"), "10Gi"),
     f"{_RESULTS}[0].consumedCapacity: want an object, got string"),
    (_set((*_RESULT, "consumedCapacity"), {"memory": True}),
     f"{_RESULTS}[0].consumedCapacity.memory: want a quantity"),
    (_set((*_DEVICES, "config"), {"opaque": {}}),
     "status.allocation.devices.config: want an array, got object"),
    (_set((*_DEVICES, "config"), ["x"]),
     "status.allocation.devices.config[0]: want an object, got string"),
    (_set((*_DEVICES, "config"), [{"opaque": "x"}]),
     "status.allocation.devices.config[0].opaque: want an object, got string"),
    (_set((*_DEVICES, "config"), [{**_OURS, "requests": "gpu"}]),
     "status.allocation.devices.config[0].requests: want an array, got string"),
    (_set((*_DEVICES, "config"), [{**_OURS, "requests": [None]}]),
     "status.allocation.devices.config[0].requests[0]: want a name"),
    (_set(("status",), []), "status: want an object, got array"),
    (_set(("metadata", "resourceVersion"), 12), "metadata.resourceVersion: want a string"),
    (_set(("status", "reservedFor"), {"name": "p"}), "status.reservedFor: want an array"),
    (_set(("status", "reservedFor"), ["pod"]), "status.reservedFor[0]: want an object"),
    (_set(("status", "reservedFor"), [{"resource": "pods", "name": 3}]),
     "status.reservedFor[0].name: want a string, got number"),
]


def _body_for(obj: Any) -> dict[str, Any]:
    """What the plugin sends the agent for ``obj``, read as dra.py reads it."""
    devices = with_configs(CLAIM, obj, our_devices(CLAIM, obj, driver=DRIVER, pool=NODE),
                           driver=DRIVER)
    return agent_body(CLAIM, obj, devices, 1)


@pytest.mark.parametrize(("change", "field"), WRONG_SHAPES,
                         ids=[field.partition(":")[0] for _, field in WRONG_SHAPES])
def test_a_claim_of_the_wrong_shape_is_an_error_naming_the_field(
        change: Callable[[dict[str, Any]], None], field: str) -> None:
    """Every part of a ResourceClaim the plugin reads is checked for its JSON type first: a
    wrong one is a ClaimError naming the field and what it wants, never a TypeError or
    AttributeError from inside."""
    obj = claim_with([result("gpu-1")])
    assert _body_for(obj)["devices"] == [{"kind": "gpu", "device": "gpu-1", "name": "gpu"}]
    change(obj)
    with pytest.raises(ClaimError) as raised:
        _body_for(obj)
    assert field in str(raised.value) and "uid-1" in str(raised.value), str(raised.value)
    assert raised.value.reason in ("bad-allocation", "bad-config", "bad-claim")


@pytest.mark.parametrize("obj", [[], "claim", None, 3])
def test_an_answer_that_is_no_claim_object_is_an_error(obj: Any) -> None:
    """The API server's answer itself must be an object."""
    with pytest.raises(ClaimError, match="the API server's ResourceClaim: want an object"):
        our_devices(CLAIM, obj, driver=DRIVER, pool=NODE)


@pytest.mark.parametrize(("answer", "field"), [
    ({"devices": {"gpu-1": []}}, "the agent's answer: devices: want an array, got object"),
    ({"devices": ["gpu-1"]}, "devices[0]: want an object, got string"),
    ({"devices": [{"device_name": 1, "cdi_devices": ["k"]}]}, "devices[0].device_name"),
    ({"devices": [{"device_name": "gpu-1", "cdi_devices": "k"}]},
     "devices[0].cdi_devices: want an array, got string"),
    ({"devices": [{"device_name": "gpu-1", "cdi_devices": [None]}]},
     "devices[0].cdi_devices[0]: want a name"),
    ({"devices": [{"device_name": "gpu-1", "cdi_devices": ["k"], "share": "s"}]},
     "devices[0].share: want an object"),
    ({"devices": [{"device_name": "gpu-1", "cdi_devices": ["k"], "share": {"share_id": 1}}]},
     "devices[0].share.share_id: want a string"),
])
def test_an_agent_answer_of_the_wrong_shape_is_an_error_naming_the_field(
        answer: dict[str, Any], field: str) -> None:
    """The agent's answer is read as strictly as the API server's claim (reason
    agent-answer), so a broken answer is an error the plugin undoes, never a crash."""
    with pytest.raises(ClaimError) as raised:
        kubelet_devices(CLAIM, [Allocated("gpu-1", NODE, ("a",), False)], answer)
    assert field in str(raised.value) and raised.value.reason == "agent-answer"
