"""Shares and sharing configs from a ResourceClaim to the agent and back to kubelet
(agent/kubeplugin/claims.py, servers.py): consumed capacity and share IDs, the opaque
``GpuConfig``/``MigDeviceConfig`` of this driver, and the share ID in kubelet's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from agent.kubeplugin.claims import (
    CONFIG_API_VERSION,
    Allocated,
    ClaimError,
    KubeletClaim,
    KubeletDevice,
    agent_body,
    kubelet_devices,
    our_devices,
    with_configs,
)
from agent.kubeplugin.dra import PrepareResult
from agent.kubeplugin.proto import dra_v1_pb2, dra_v1beta1_pb2
from agent.kubeplugin.servers import DraServicer
from tests.kubeplugin.conftest import DRIVER, NODE, resource_claim, result

CLAIM = KubeletClaim("ns", "uid-1", "c")
MIG = "gpu-1-mig-1g10gb-19-0"
MPS = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                        "defaultPinnedDeviceMemoryLimit": "10Gi"}}
SLICED = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}


def share(device: str, share_id: str, memory: str, request: str = "gpu") -> dict[str, Any]:
    return {**result(device, request), "shareID": share_id,
            "consumedCapacity": {"memory": memory}}


def claim_of(results: list[dict[str, Any]],
             configs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    obj = resource_claim("c", "uid-1", results, namespace="ns")
    if configs:
        obj["status"]["allocation"]["devices"]["config"] = list(configs)
    return obj


def config(kind: str = "GpuConfig", sharing: Any = None, *, requests: Sequence[str] = (),
           source: str = "FromClaim", driver: str = DRIVER,
           api_version: str = CONFIG_API_VERSION, **extra: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": api_version, "kind": kind, **extra}
    if sharing is not None:
        parameters["sharing"] = sharing
    entry: dict[str, Any] = {"source": source,
                             "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def test_shares_are_devices_of_their_own_with_capacity_and_share_id() -> None:
    """Each result with a shareID is one share, even two of one device in a claim; its
    consumed memory and share ID go to the agent as capacity and share_id."""
    obj = claim_of([share("gpu-0", "s-1", "10Gi", "a"), share("gpu-0", "s-2", "20Gi", "b"),
                    result("gpu-1", "c")])
    devices = our_devices(CLAIM, obj, driver=DRIVER, pool=NODE)
    assert devices == [
        Allocated("gpu-0", NODE, ("a",), False, share_id="s-1", memory="10Gi"),
        Allocated("gpu-0", NODE, ("b",), False, share_id="s-2", memory="20Gi"),
        Allocated("gpu-1", NODE, ("c",), False)]
    body = agent_body(CLAIM, obj, devices, 5)
    assert body["devices"] == [
        {"kind": "gpu", "device": "gpu-0", "name": "a", "capacity": {"memory": "10Gi"},
         "share_id": "s-1"},
        {"kind": "gpu", "device": "gpu-0", "name": "b", "capacity": {"memory": "20Gi"},
         "share_id": "s-2"},
        {"kind": "gpu", "device": "gpu-1", "name": "c"}]


def test_each_share_goes_back_to_kubelet_with_the_share_id_the_agent_answers() -> None:
    """kubelet's devices pair each share with the agent's device of the same name and share
    ID; a device without a share ID has none."""
    devices = [Allocated("gpu-0", NODE, ("a",), False, share_id="s-1", memory="10Gi"),
               Allocated("gpu-0", NODE, ("b",), False, share_id="s-2", memory="20Gi"),
               Allocated("gpu-1", NODE, ("c",), False)]
    answer = {"devices": [
        {"device_name": "gpu-0", "cdi_devices": ["k/claim=uid-1-gpu-0-s-2"],
         "share": {"memory_mib": 20480, "share_id": "s-2"}},
        {"device_name": "gpu-0", "cdi_devices": ["k/claim=uid-1-gpu-0-s-1"],
         "share": {"memory_mib": 10240, "share_id": "s-1"}},
        {"device_name": "gpu-1", "cdi_devices": ["k/claim=uid-1-gpu-1"], "share": None}]}
    assert kubelet_devices(CLAIM, devices, answer) == [
        KubeletDevice(("a",), NODE, "gpu-0", ("k/claim=uid-1-gpu-0-s-1",), share_id="s-1"),
        KubeletDevice(("b",), NODE, "gpu-0", ("k/claim=uid-1-gpu-0-s-2",), share_id="s-2"),
        KubeletDevice(("c",), NODE, "gpu-1", ("k/claim=uid-1-gpu-1",))]


def test_a_share_of_the_whole_gpu_answered_as_the_whole_gpu_keeps_its_share_id() -> None:
    """A share of all of a GPU that the agent prepares as the whole GPU (no share in its
    answer) still goes back to kubelet with the allocation's share ID."""
    devices = [Allocated("gpu-0", NODE, ("a",), False, share_id="s-1", memory="44Gi")]
    answer = {"devices": [{"device_name": "gpu-0", "cdi_devices": ["x"], "share": None}]}
    assert kubelet_devices(CLAIM, devices, answer) == [
        KubeletDevice(("a",), NODE, "gpu-0", ("x",), share_id="s-1")]


def test_a_share_the_agent_did_not_answer_is_an_error_naming_it() -> None:
    """A share missing from the agent's answer fails the claim, naming device and share."""
    devices = [Allocated("gpu-0", NODE, ("a",), False, share_id="s-1", memory="10Gi")]
    answer = {"devices": [{"device_name": "gpu-0", "cdi_devices": ["x"],
                           "share": {"memory_mib": 1024, "share_id": "s-9"}}]}
    with pytest.raises(ClaimError, match=r"gpu-0 \(share s-1\)"):
        kubelet_devices(CLAIM, devices, answer)


GPU0, GPU1 = result("gpu-0", "big"), result(MIG, "small")

# (what, configs, sharing of gpu-0 and of the MIG device, or a needle of the error)
CONFIGS: list[tuple[str, list[dict[str, Any]], tuple[Any, Any] | str]] = [
    ("no configs", [], (None, None)),
    ("an unscoped GpuConfig applies to full GPUs only", [config(sharing=MPS)], (MPS, None)),
    ("an unscoped MigDeviceConfig applies to MIG devices only",
     [config("MigDeviceConfig", {"strategy": "MPS"})], (None, {"strategy": "MPS"})),
    ("the claim's config wins over the class's, whatever the order",
     [config(sharing=MPS), config(sharing=SLICED, source="FromClass")], (MPS, None)),
    ("the last of the claim's configs wins", [config(sharing=SLICED), config(sharing=MPS)],
     (MPS, None)),
    ("a config scoped to another request does not apply",
     [config(sharing=MPS), config(sharing=SLICED, requests=["other"])], (MPS, None)),
    ("a config naming the parent request covers its subrequests",
     [config("MigDeviceConfig", {"strategy": "MPS"}, requests=["small"])],
     (None, {"strategy": "MPS"})),
    ("a GpuConfig scoped to a MIG device's request is an error naming both",
     [config(sharing=MPS, requests=["small"])],
     f"cannot apply a GpuConfig to {MIG} (request small/mig), which takes a "
     "MigDeviceConfig"),
    ("a MigDeviceConfig scoped to a GPU's request is an error naming both",
     [config("MigDeviceConfig", {"strategy": "MPS"}, requests=["big"])],
     "cannot apply a MigDeviceConfig to gpu-0 (request big), which takes a GpuConfig"),
    ("another driver's config is ignored, whatever it holds",
     [config("Whatever", {"x": 1}, driver="gpu.nvidia.com",
             api_version="resource.nvidia.com/v1beta1")], (None, None)),
    ("NVIDIA's apiVersion for this driver is refused",
     [config(sharing=MPS, api_version="resource.nvidia.com/v1beta1")],
     "apiVersion 'resource.nvidia.com/v1beta1' kind 'GpuConfig' is not a config of this "
     "driver"),
    ("an unknown kind for this driver is refused", [config("VfioDeviceConfig")],
     "kind 'VfioDeviceConfig' is not a config of this driver"),
    ("an unknown top-level field is refused", [config(sharing=MPS, extra=True)],
     "unknown field 'extra'"),
    ("an unknown sharing field is refused", [config(sharing={**MPS, "multiUser": True})],
     "unknown field 'multiUser'"),
    ("an unknown mpsConfig field is refused",
     [config(sharing={"strategy": "MPS", "mpsConfig": {"limit": 1}})],
     "sharing.mpsConfig: unknown field 'limit'"),
    ("a MigDeviceConfig has no timeSlicingConfig",
     [config("MigDeviceConfig", SLICED)], "unknown field 'timeSlicingConfig'"),
    ("sharing must be an object", [config(sharing="MPS")], "wants an object"),
    ("per-device limits must be a map",
     [config(sharing={"strategy": "MPS", "mpsConfig": {
         "defaultPerDevicePinnedMemoryLimit": "1Gi"}})], "a map of device"),
    ("a config without sharing takes the class's away",
     [config(sharing=MPS, source="FromClass"), config()], (None, None)),
    ("values are passed as they are: the agent validates them",
     [config(sharing={"strategy": "Bogus", "timeSlicingConfig": {"interval": 9}})],
     ({"strategy": "Bogus", "timeSlicingConfig": {"interval": 9}}, None)),
]


@pytest.mark.parametrize(("what", "configs", "expected"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_sharing_configs(what: str, configs: list[dict[str, Any]],
                         expected: tuple[Any, Any] | str) -> None:
    """The sharing a device gets from this driver's opaque configs, or the error that says
    which config and why."""
    obj = claim_of([GPU0, {**GPU1, "request": "small/mig"}], configs)
    devices = our_devices(CLAIM, obj, driver=DRIVER, pool=NODE)
    if isinstance(expected, str):
        with pytest.raises(ClaimError) as raised:
            with_configs(CLAIM, obj, devices, driver=DRIVER)
        assert expected in str(raised.value) and raised.value.reason == "bad-config"
        assert str(CLAIM) in str(raised.value)
        return
    configured = with_configs(CLAIM, obj, devices, driver=DRIVER)
    assert tuple(d.sharing for d in configured) == expected
    body = agent_body(CLAIM, obj, configured, 1)
    assert tuple(e.get("sharing") for e in body["devices"]) == expected


class _Service:
    """Answers every prepare with one share and one plain device."""

    async def prepare(self, claims: Sequence[KubeletClaim],
                      issued_at_ns: int) -> dict[str, PrepareResult]:
        return {c.uid: PrepareResult(devices=(
            KubeletDevice(("a",), NODE, "gpu-0", ("cdi-a",), share_id="s-1"),
            KubeletDevice(("b",), NODE, "gpu-1", ("cdi-b",)))) for c in claims}


@pytest.mark.parametrize(("pb2", "expected"), [
    (dra_v1_pb2, ["s-1", None]),
    (dra_v1beta1_pb2, [None, None]),  # v1beta1 has no share_id: nothing to send it in
])
def test_kubelet_gets_the_share_id_in_the_v1_protocol(pb2: Any, expected: list[Any]) -> None:
    """NodePrepareResources answers a share's ID in v1's share_id (field 5, unset for a
    device that is no share); v1beta1's Device has no such field."""
    servicer = DraServicer(_Service(), pb2)  # type: ignore[arg-type]
    request = pb2.NodePrepareResourcesRequest(claims=[pb2.Claim(namespace="ns", uid="u",
                                                                name="c")])
    answer = asyncio.run(servicer.NodePrepareResources(request, None))
    devices = answer.claims["u"].devices
    shares = [d.share_id if "share_id" in pb2.Device.DESCRIPTOR.fields_by_name
              and d.HasField("share_id") else None for d in devices]
    assert shares == expected
    assert [d.device_name for d in devices] == ["gpu-0", "gpu-1"]
