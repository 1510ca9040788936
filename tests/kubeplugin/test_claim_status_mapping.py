"""The claim device status mapping (agent/kubeplugin/claim_status.py), pure: the agent's
prepare answer to each entry's ``data``, entry keys from the allocation, the ``Healthy``
condition from a device's taints, and how an apply's answer tells a server that drops
``status.devices``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.kubeplugin.claim_status import (
    MAX_DATA_BYTES,
    Condition,
    StatusDevice,
    apply_body,
    device_data,
    entry,
    health_condition,
    kept_entries,
    rfc3339,
    status_devices,
    stored_times,
)
from agent.kubeplugin.claims import Allocated
from agent.kubeplugin.device_health import DeviceState

Json = dict[str, Any]
DRIVER, POOL = "gpu.nodeagent.dev", "node-a"
CDI = "k8s.gpu.nodeagent.dev/claim=u1-gpu-0"


def answered(name: str, **extra: Any) -> Json:
    """One device of the agent's ``PUT /v1/claims`` answer."""
    return {"request": "gpu", "kind": "gpu", "uuid": "GPU-0", "parent_uuid": None,
            "pool": POOL, "device_name": name, "on_demand": False, "admin_access": False,
            "cdi_devices": [CDI], "sharing": None, "share": None, "mig": None, **extra}


MPS_DAEMON = {"root": "/run/gpu-agent/mps/u1", "pipe_directory": "/run/gpu-agent/mps/u1/pipe",
              "devices": ["GPU-0"], "state": "running", "reason": None}

#: name -> (answer device, the claim's MPS daemon, the data wanted)
DATA: dict[str, tuple[Json, Json | None, Json]] = {
    "a whole GPU: its UUID and CDI devices": (
        answered("gpu-0"), None, {"uuid": "GPU-0", "cdiDevices": [CDI]}),
    "a MIG device: profile, instance IDs, placement and its parent GPU": (
        answered("gpu-0-mig-1g10gb-19-3", kind="mig", uuid="MIG-1", parent_uuid="GPU-0",
                 mig={"profile": "1g.10gb", "gi_id": 9, "ci_id": 0,
                      "placement": {"start": 3, "size": 1}}), None,
        {"uuid": "MIG-1", "parentUUID": "GPU-0", "cdiDevices": [CDI],
         "mig": {"profile": "1g.10gb", "gpuInstance": 9, "computeInstance": 0,
                 "placement": {"start": 3, "size": 1}}}),
    "time-slicing: the strategy and interval": (
        answered("gpu-0", sharing={"strategy": "TimeSlicing", "interval": "Long",
                                   "thread_percentage": None, "pinned_limit_mib": None}),
        None, {"uuid": "GPU-0", "cdiDevices": [CDI],
               "sharing": {"strategy": "TimeSlicing", "interval": "Long"}}),
    "an MPS share: pipe directory, limits, share size and ID": (
        answered("gpu-0", sharing={"strategy": "MPS", "interval": None,
                                   "thread_percentage": 50, "pinned_limit_mib": 4096},
                 share={"memory_mib": 10240, "share_id": "5f0c"}), MPS_DAEMON,
        {"uuid": "GPU-0", "cdiDevices": [CDI], "sharing": {"strategy": "MPS"},
         "mps": {"pipeDirectory": "/run/gpu-agent/mps/u1/pipe", "activeThreadPercentage": 50,
                 "pinnedDeviceMemoryLimit": "4096Mi"},
         "share": {"memory": "10240Mi", "shareID": "5f0c"}}),
    "MPS without limits: the pipe directory alone": (
        answered("gpu-0", sharing={"strategy": "MPS", "interval": None,
                                   "thread_percentage": None, "pinned_limit_mib": None}),
        MPS_DAEMON, {"uuid": "GPU-0", "cdiDevices": [CDI], "sharing": {"strategy": "MPS"},
                     "mps": {"pipeDirectory": "/run/gpu-agent/mps/u1/pipe"}}),
    "an answer of odd shapes leaves those parts out, never fails": (
        {"device_name": "gpu-0", "uuid": "GPU-0", "mig": "x", "share": [1], "sharing": 7,
         "cdi_devices": []}, None, {"uuid": "GPU-0"}),
}


@pytest.mark.parametrize("name", DATA)
def test_device_data_says_how_to_find_the_device(name: str) -> None:
    """Each entry's data carries what a user needs to find the device, nothing null."""
    prepared, mps, want = DATA[name]
    assert device_data(prepared, mps) == want


def test_device_data_stays_under_the_apis_limit() -> None:
    """An answer whose data would pass the API's 10 KiB keeps only the UUIDs."""
    huge = answered("gpu-0", cdi_devices=[f"k8s.gpu.nodeagent.dev/claim={'x' * 200}-{i}"
                                          for i in range(80)])
    data = device_data(huge, None)
    assert data == {"uuid": "GPU-0"} and len(json.dumps(huge)) > MAX_DATA_BYTES


def allocated(device: str, share_id: str | None = None) -> Allocated:
    return Allocated(device, POOL, ("gpu",), False, share_id=share_id)


#: name -> (allocated devices, answer devices, (device, shareID, uuid) of each entry)
KEYS: dict[str, tuple[list[Allocated], list[Json], list[tuple[str, str | None, Any]]]] = {
    "one entry per allocated device, keyed as the allocation": (
        [allocated("gpu-0"), allocated("gpu-1")],
        [answered("gpu-1", uuid="GPU-1"), answered("gpu-0")],
        [("gpu-0", None, "GPU-0"), ("gpu-1", None, "GPU-1")]),
    "two shares of one GPU: each its own share's data": (
        [allocated("gpu-0", "s-1"), allocated("gpu-0", "s-2")],
        [answered("gpu-0", uuid="A", share={"memory_mib": 1024, "share_id": "s-2"}),
         answered("gpu-0", uuid="B", share={"memory_mib": 1024, "share_id": "s-1"})],
        [("gpu-0", "s-1", "B"), ("gpu-0", "s-2", "A")]),
    "a share ID the agent assigned is not the key (the server checks the allocation's)": (
        [allocated("gpu-0")],
        [answered("gpu-0", share={"memory_mib": 1024, "share_id": "agent-made"})],
        [("gpu-0", None, "GPU-0")]),
    "a share prepared as the whole GPU keeps the allocation's share ID": (
        [allocated("gpu-0", "s-1")], [answered("gpu-0")], [("gpu-0", "s-1", "GPU-0")]),
    "a device the answer does not name still gets its entry, without data": (
        [allocated("gpu-0"), allocated("gpu-7")], [answered("gpu-0")],
        [("gpu-0", None, "GPU-0"), ("gpu-7", None, None)]),
}


@pytest.mark.parametrize("name", KEYS)
def test_entries_are_keyed_by_the_allocation(name: str) -> None:
    devices, answer, want = KEYS[name]
    got = status_devices(devices, {"devices": answer, "mps": None})
    assert [(d.device, d.share_id, d.data.get("uuid")) for d in got] == want


TAINT_XID = {"key": "gpu.nodeagent.dev/xid", "value": "48", "effect": "NoSchedule",
             "timeAdded": "2026-12-02T16:40:01Z"}
TAINT_APP = {"key": "gpu.nodeagent.dev/xid", "value": "31", "effect": "None",
             "timeAdded": "2026-12-02T16:40:01Z"}
TAINT_LOST = {"key": "gpu.nodeagent.dev/gpu-lost", "effect": "NoExecute",
              "timeAdded": "2026-12-02T16:40:01Z"}

HEALTH: dict[str, tuple[DeviceState, Condition]] = {
    "no taint: healthy": (DeviceState("Healthy"), Condition("Healthy", "True", "NoTaints", "")),
    "an informational taint: healthy, the taint said": (
        DeviceState("Healthy", (TAINT_APP,)),
        Condition("Healthy", "True", "InformationalTaints", "gpu.nodeagent.dev/xid=31:None")),
    "a NoSchedule XID taint: unhealthy, naming the XID": (
        DeviceState("Unhealthy", (TAINT_XID, TAINT_APP)),
        Condition("Healthy", "False", "Tainted",
                  "gpu.nodeagent.dev/xid=48:NoSchedule, gpu.nodeagent.dev/xid=31:None")),
    "a lost GPU: unhealthy": (
        DeviceState("Unhealthy", (TAINT_LOST,)),
        Condition("Healthy", "False", "Tainted", "gpu.nodeagent.dev/gpu-lost:NoExecute")),
    "the agent away or the device gone: unknown": (
        DeviceState("Unknown"),
        Condition("Healthy", "Unknown", "HealthUnknown",
                  "the GPU agent does not answer or does not publish this device")),
}


@pytest.mark.parametrize("name", HEALTH)
def test_the_health_condition_follows_the_taints(name: str) -> None:
    state, want = HEALTH[name]
    assert health_condition(state) == want


def test_an_entry_and_its_apply_body_are_the_apis_shape() -> None:
    """An entry has the API's keys (driver, pool, device, shareID only for a share), the
    conditions with their times, and data only when there is some; the body names the
    claim by name, namespace and UID and holds exactly the entries."""
    ready = Condition("Ready", "True", "Prepared", "prepared")
    share = entry(DRIVER, POOL, StatusDevice("gpu-0", "s-1", {"uuid": "GPU-0"}),
                  [(ready, "2026-12-02T16:40:01Z")])
    assert share == {"driver": DRIVER, "pool": POOL, "device": "gpu-0", "shareID": "s-1",
                     "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                                     "message": "prepared",
                                     "lastTransitionTime": "2026-12-02T16:40:01Z"}],
                     "data": {"uuid": "GPU-0"}}
    bare = entry(DRIVER, POOL, StatusDevice("gpu-1", None), [])
    assert "shareID" not in bare and "data" not in bare
    assert apply_body("ns", "c", "u1", []) == {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": "u1"}, "status": {"devices": []}}
    assert rfc3339(1796229601.7) == "2026-12-02T16:40:01Z"


def test_an_answer_without_the_entries_means_the_server_drops_the_field() -> None:
    sent = [{"driver": DRIVER, "pool": POOL, "device": "gpu-0"},
            {"driver": DRIVER, "pool": POOL, "device": "gpu-0", "shareID": "s"}]
    kept = {"status": {"devices": [{**e, "conditions": []} for e in sent]}}
    assert kept_entries(sent, kept)
    assert not kept_entries(sent, {"status": {"allocation": {}}})
    assert not kept_entries(sent, {"status": {"devices": [sent[0]]}})
    assert kept_entries([], {"status": {}})


def test_stored_times_are_this_drivers_and_pools_only() -> None:
    """A restarted plugin takes back the times of its own entries' conditions, keyed by
    device and share, and none of another driver's or pool's."""
    cond = {"type": "Healthy", "status": "False", "lastTransitionTime": "T1"}
    claim = {"status": {"devices": [
        {"driver": DRIVER, "pool": POOL, "device": "gpu-0", "shareID": "s", "conditions": [
            cond, {"type": "Ready", "status": "True", "lastTransitionTime": "T0"}]},
        {"driver": "other.example.com", "pool": POOL, "device": "gpu-0",
         "conditions": [cond]},
        {"driver": DRIVER, "pool": "node-b", "device": "gpu-1", "conditions": [cond]},
        "junk"]}}
    assert stored_times(claim, DRIVER, POOL) == {
        (("gpu-0", "s"), "Healthy"): ("False", "T1"), (("gpu-0", "s"), "Ready"): ("True", "T0")}
