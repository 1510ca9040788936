"""The publisher's pure planning (agent slices + server slices -> writes) and the check for
fields the server dropped."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.kubeplugin.resource_slice_plan import (
    InvalidDesired,
    Written,
    desired_resource_slices,
    digest,
    dropped_fields,
    plan,
    same_value,
    share_fields,
    without_counters,
    without_shares,
)

NODE, UID, DRIVER = "node-a", "uid-a", "gpu.nodeagent.dev"
Json = dict[str, Any]


def agent_slice(name: str, *devices: str, generation: int = 1) -> Json:
    """A slice as the agent renders it (its pool and driver; no owner)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                     "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": d, "attributes": {"type": {"string": "gpu"}}}
                                 for d in devices]}}


_versions = itertools.count(100)


def stored(body: Json, *, generation: int | None = None, uid: str | None = None) -> Json:
    """``body`` as a server holds it: a UID, a resourceVersion, a creation time."""
    item = copy.deepcopy(body)
    if generation is not None:
        item["spec"]["pool"]["generation"] = generation
    item["metadata"].update(uid=uid or f"s-{item['metadata']['name']}",
                            resourceVersion=str(next(_versions)),
                            creationTimestamp="2026-12-01T00:00:00Z")
    return item


def published(*items: Json, generation: int, owner: str = UID) -> list[Json]:
    """What the publisher writes for these agent slices, as stored on the server."""
    return [stored(b) for b in desired_resource_slices(
        list(items), node_name=NODE, node_uid=owner, driver=DRIVER, generation=generation)]


A, B, C = (agent_slice("s-0", "gpu-0"), agent_slice("s-1", "gpu-1"),
           agent_slice("s-2", "gpu-2"))


@dataclass
class Case:
    agent: list[Json]
    server: list[Json]
    generation: int
    deletes: tuple[str, ...] = ()
    updates: tuple[str, ...] = ()
    creates: tuple[str, ...] = ()
    written: dict[str, Written] = field(default_factory=dict)


def _with(items: list[Json], edit: Any) -> list[Json]:
    items = copy.deepcopy(items)
    edit(items)
    return items


def _gen(n: int, *items: Json) -> list[Json]:
    return [agent_slice(i["metadata"]["name"],
                        *(d["name"] for d in i["spec"]["devices"]), generation=n) for i in items]


CASES = {
    "an empty server gets every slice at the agent's generation":
        Case(_gen(3, A, B), [], 3, creates=("s-0", "s-1")),
    "a server already holding the pool gets nothing":
        Case(_gen(3, A, B), published(A, B, generation=3), 3),
    "a pool at a higher generation with the same content is left as it is":
        Case(_gen(1, A, B), published(A, B, generation=7), 7),
    "changed content is written above every existing generation":
        Case(_gen(2, A, agent_slice("s-1", "gpu-9")), published(A, B, generation=5), 6,
             updates=("s-0", "s-1")),
    "the agent's generation wins when it is the higher":
        Case(_gen(9, A, agent_slice("s-1", "gpu-9")), published(A, B, generation=5), 9,
             updates=("s-0", "s-1")),
    "a new slice is created and the others rewritten at the new generation":
        Case(_gen(4, A, B, C), published(A, B, generation=3), 4, updates=("s-0", "s-1"),
             creates=("s-2",)),
    "a leftover slice is deleted without touching the rest":
        Case(_gen(3, A, B), [*published(A, B, generation=3),
                             stored(agent_slice("old-7", "gpu-7"))], 3, deletes=("old-7",)),
    "slices of mixed generations are rewritten above the highest":
        Case(_gen(2, A, B), published(A, generation=2) + published(B, generation=4), 5,
             updates=("s-0", "s-1")),
    "no agent slices deletes the whole pool":
        Case([], published(A, B, generation=3), 0, deletes=("s-0", "s-1")),
    "slices owned by a previous Node object (another UID) are rewritten":
        Case(_gen(3, A), published(A, generation=3, owner="uid-old"), 4, updates=("s-0",)),
    "fields the server added (defaults, status) leave a slice in sync":
        Case(_gen(3, A), _with(published(A, generation=3), lambda items: items[0]["spec"]
                               ["devices"][0].update(allowMultipleAllocations=False)), 3),
    "a field missing on the server is rewritten":
        Case(_gen(3, A), _with(published(A, generation=3), lambda items: items[0]["spec"]
                               ["devices"][0].pop("attributes")), 4, updates=("s-0",)),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_plan(case: Case) -> None:
    """Each situation gets exactly the writes and the generation its name says."""
    result = plan(case.agent, case.server, node_name=NODE, node_uid=UID, driver=DRIVER,
                  written=case.written)
    assert result.generation == case.generation
    assert tuple(d.name for d in result.deletes) == case.deletes
    assert tuple(b["metadata"]["name"] for b in result.updates) == case.updates
    assert tuple(b["metadata"]["name"] for b in result.creates) == case.creates
    for body in (*result.updates, *result.creates):
        assert body["spec"]["pool"] == {"name": NODE, "generation": case.generation,
                                        "resourceSliceCount": len(case.agent)}
        assert body["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}]


def test_deletes_carry_the_uid_and_resource_version_read() -> None:
    """An obsolete slice is deleted with the UID and resourceVersion it was read with, so a
    slice someone recreated meanwhile survives."""
    leftover = stored(agent_slice("old-7", "gpu-7"), uid="u-7")
    result = plan([], [leftover], node_name=NODE, node_uid=UID, driver=DRIVER)
    assert [(d.name, d.uid, d.resource_version) for d in result.deletes] == [
        ("old-7", "u-7", leftover["metadata"]["resourceVersion"])]


def test_updates_carry_the_resource_version_read() -> None:
    """An update names the resourceVersion it was planned from (optimistic concurrency)."""
    server = published(B, generation=1)
    result = plan(_gen(2, agent_slice("s-1", "gpu-5")), server, node_name=NODE, node_uid=UID,
                  driver=DRIVER)
    assert result.updates[0]["metadata"]["resourceVersion"] == \
        server[0]["metadata"]["resourceVersion"]


def test_own_write_as_answered_is_in_sync() -> None:
    """A slice that is still the object this publisher wrote is in sync even where the
    server rewrote values; without that record (a restarted plugin) a quantity the server
    made canonical (1024Mi as 1Gi) is in sync too, and another value is rewritten."""
    body = desired_resource_slices(_gen(3, A), node_name=NODE, node_uid=UID, driver=DRIVER,
                                   generation=3)[0]
    body["spec"]["devices"][0]["capacity"] = {"memory": {"value": "1024Mi"}}
    answer = stored(body)
    answer["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Gi"
    agent = [copy.deepcopy(body)]
    agent[0]["metadata"].pop("ownerReferences")
    record = {"s-0": Written(answer["metadata"]["resourceVersion"], digest(body), 3)}
    assert plan(agent, [answer], node_name=NODE, node_uid=UID, driver=DRIVER,
                written=record).empty
    assert plan(agent, [answer], node_name=NODE, node_uid=UID, driver=DRIVER).empty
    answer["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1000Mi"
    assert not plan(agent, [answer], node_name=NODE, node_uid=UID, driver=DRIVER).empty


def test_driver_and_node_are_the_publishers() -> None:
    """Slices are written with the plugin's driver and node (what its watch selects on),
    whatever the agent rendered."""
    other = copy.deepcopy(A)
    other["spec"].update(driver="other.example.com", nodeName="elsewhere")
    other["spec"]["pool"]["name"] = "elsewhere"
    body = plan([other], [], node_name=NODE, node_uid=UID, driver=DRIVER).creates[0]
    assert (body["spec"]["driver"], body["spec"]["nodeName"], body["spec"]["pool"]["name"]) \
        == (DRIVER, NODE, NODE)


def test_duplicate_names_are_refused() -> None:
    """Two agent slices of one name cannot both be published: the plan says so."""
    with pytest.raises(InvalidDesired):
        plan([A, copy.deepcopy(A)], [], node_name=NODE, node_uid=UID, driver=DRIVER)


# --- convergence: whatever the server holds, one plan applied makes it the agent's pool ---

_names = st.sampled_from([f"s-{i}" for i in range(5)])
_devices = st.lists(st.sampled_from([f"gpu-{i}" for i in range(4)]), max_size=3, unique=True)
_agent = st.dictionaries(_names, _devices, max_size=4)
_server = st.dictionaries(
    st.one_of(_names, st.sampled_from(["stale-0", "stale-1"])),
    st.tuples(_devices, st.integers(0, 12), st.sampled_from([UID, "uid-old"])), max_size=5)


def _apply(server: dict[str, Json], result: Any, written: dict[str, Written]) -> None:
    for gone in result.deletes:
        assert server[gone.name]["metadata"]["uid"] == gone.uid
        del server[gone.name]
        written.pop(gone.name, None)
    for body in (*result.updates, *result.creates):
        item = stored(body)
        server[body["metadata"]["name"]] = item
        written[body["metadata"]["name"]] = Written(item["metadata"]["resourceVersion"],
                                                    digest(body), result.generation)


@settings(max_examples=150, deadline=None)
@given(agent=_agent, server=_server, agent_generation=st.integers(1, 10))
def test_one_plan_converges(agent: dict[str, list[str]],
                            server: dict[str, tuple[list[str], int, str]],
                            agent_generation: int) -> None:
    """For any server content, applying one plan leaves exactly the agent's slices at one
    generation (when it writes: no lower than the agent's, above every one it replaces),
    and a second plan is empty."""
    desired = [agent_slice(name, *devices, generation=agent_generation)
               for name, devices in sorted(agent.items())]
    held = {}
    for name, (devices, generation, owner) in server.items():
        body = desired_resource_slices([agent_slice(name, *devices)], node_name=NODE,
                                       node_uid=owner, driver=DRIVER, generation=generation)[0]
        held[name] = stored(body)
    before = max((g for _, g, _ in server.values()), default=0)
    written: dict[str, Written] = {}
    first = plan(desired, list(held.values()), node_name=NODE, node_uid=UID, driver=DRIVER)
    _apply(held, first, written)
    assert sorted(held) == sorted(agent)
    generations = {item["spec"]["pool"]["generation"] for item in held.values()}
    assert len(generations) <= 1
    if first.writes:
        assert generations == {first.generation}
        assert first.generation >= agent_generation and first.generation > before
    for name, item in held.items():
        assert [d["name"] for d in item["spec"]["devices"]] == agent[name]
        assert item["spec"]["pool"]["resourceSliceCount"] == len(agent)
        assert item["metadata"]["ownerReferences"][0]["uid"] == UID
    assert plan(desired, list(held.values()), node_name=NODE, node_uid=UID, driver=DRIVER,
                written=written).empty
    assert plan(desired, list(held.values()), node_name=NODE, node_uid=UID,
                driver=DRIVER).empty


# --- dropped fields ---

COUNTERS = {"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "40960Mi"}}}
WRITTEN = {"spec": {
    "sharedCounters": [{"name": "gpu-0-counter-set", "counters": {"memory": {"value": "80Gi"}}}],
    "devices": [{"name": "gpu-0-mig-1g", "consumesCounters": [COUNTERS],
                 "capacity": {"memory": {"value": "10240Mi"}}, "taints": [],
                 "attributes": {"type": {"string": "mig"}}},
                {"name": "gpu-0-mig-2g", "consumesCounters": [COUNTERS],
                 "attributes": {"type": {"string": "mig"}}}]}}


def _read(edit: Any) -> Json:
    doc = copy.deepcopy(WRITTEN)
    edit(doc)
    return doc


DROPS = {
    "the same object": (lambda doc: None, ()),
    "counters dropped (DRAPartitionableDevices off)": (
        lambda doc: [doc["spec"].pop("sharedCounters"),
                     *(d.pop("consumesCounters") for d in doc["spec"]["devices"])],
        ("spec.devices[].consumesCounters", "spec.sharedCounters")),
    "capacity dropped on one device": (
        lambda doc: doc["spec"]["devices"][0].pop("capacity"), ("spec.devices[].capacity",)),
    "a canonical quantity is not a drop": (
        lambda doc: doc["spec"]["devices"][0]["capacity"]["memory"].update(value="10Gi"), ()),
    "an omitted empty list is not a drop": (
        lambda doc: doc["spec"]["devices"][0].pop("taints"), ()),
    "fields the server added are not drops": (
        lambda doc: doc["spec"].update(perDeviceNodeSelection=False), ()),
    "a shorter list is a drop of its items": (
        lambda doc: doc["spec"]["devices"].pop(), ("spec.devices[]",)),
}


@pytest.mark.parametrize(("edit", "expected"), list(DROPS.values()), ids=list(DROPS))
def test_dropped_fields(edit: Any, expected: tuple[str, ...]) -> None:
    """Fields written but missing from the read-back are named by path; rewritten values,
    omitted empties and added fields are not."""
    assert dropped_fields(WRITTEN, _read(edit)) == expected


@pytest.mark.parametrize(("key", "wanted", "actual", "same"), [
    ("value", "81920Mi", "80Gi", True),
    ("value", "1024Mi", "1Gi", True),
    ("value", "1500m", "1.5", True),
    ("value", "1k", "1000", True),
    ("value", "2e3", "2k", True),
    ("value", "1000Mi", "1Gi", False),
    ("value", "80G", "80Gi", False),
    ("string", "1024Mi", "1Gi", False),  # an attribute's string is compared as written
    ("value", "not-a-quantity", "not-a-quantity", True),
    ("value", "x", "y", False),
])
def test_quantities_compare_by_value(key: str, wanted: str, actual: str, same: bool) -> None:
    """Under a quantity key, a quantity the server wrote canonically is the same value; any
    other string is compared as it is."""
    assert same_value(wanted, actual, key) is same


def _slice(name: str, devices: list[dict[str, Any]], counters: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"devices": devices}
    if counters:
        spec["sharedCounters"] = [{"name": "gpu-0-counter-set", "counters": {}}]
    return {"metadata": {"name": name}, "spec": spec}


PLAIN = {"name": "gpu-1"}
CONSUMING = {"name": "gpu-0-mig-1g10gb-19-0",
             "consumesCounters": [{"counterSet": "gpu-0-counter-set", "counters": {}}]}


@pytest.mark.parametrize(("pool", "kept"), [
    ([_slice("a", [PLAIN, CONSUMING])], [("a", ["gpu-1"])]),
    ([_slice("a", [], counters=True), _slice("b", [CONSUMING]), _slice("c", [PLAIN])],
     [("c", ["gpu-1"])]),
    ([_slice("a", [], counters=True), _slice("b", [CONSUMING])], [("a", [])]),
    ([], []),
], ids=["mixed slice", "counter and device slices go", "one empty slice stays", "empty pool"])
def test_without_counters_keeps_only_devices_that_consume_none(
        pool: list[dict[str, Any]], kept: list[tuple[str, list[str]]]) -> None:
    """Where the server keeps no counters, the pool keeps its devices that consume none, no
    counter sets, and at least one slice."""
    out = without_counters(pool)
    assert [(s["metadata"]["name"], [d["name"] for d in s["spec"]["devices"]]) for s in out] \
        == kept
    assert not any("sharedCounters" in s["spec"] for s in out)


SHAREABLE = {"name": "gpu-2", "allowMultipleAllocations": True, "attributes": {
    "type": {"string": "gpu"}, "shareable": {"bool": True}}, "capacity": {
    "memory": {"value": "44Gi", "requestPolicy": {"default": "44Gi", "validRange": {
        "min": "1Gi", "max": "44Gi", "step": "1Gi"}}}}}


def test_without_shares_publishes_every_gpu_whole() -> None:
    """Where the server keeps no consumable capacity, every device is exclusive (no
    allowMultipleAllocations, no request policy, no ``shareable`` attribute for
    share.nodeagent.dev to select) with its capacity values, and the server's
    read-back of the shareable pool is exactly that (nothing to rewrite again)."""
    pool = [_slice("a", [SHAREABLE, PLAIN])]
    out = without_shares(pool)
    assert out[0]["spec"]["devices"] == [
        {"name": "gpu-2", "attributes": {"type": {"string": "gpu"}},
         "capacity": {"memory": {"value": "44Gi"}}}, PLAIN]
    assert SHAREABLE["allowMultipleAllocations"] is True  # the agent's pool is left alone
    assert dropped_fields(pool[0], out[0]) == (
        "spec.devices[].allowMultipleAllocations",
        "spec.devices[].attributes.shareable",
        "spec.devices[].capacity.memory.requestPolicy")


@pytest.mark.parametrize(("dropped", "shares"), [
    (("spec.devices[].allowMultipleAllocations",),
     ("spec.devices[].allowMultipleAllocations",)),
    (("spec.devices[].capacity.memory.requestPolicy", "spec.sharedCounters"),
     ("spec.devices[].capacity.memory.requestPolicy",)),
    (("spec.devices[].consumesCounters", "spec.devices[].taints"), ()),
])
def test_share_fields_are_the_consumable_capacity_ones(dropped: tuple[str, ...],
                                                       shares: tuple[str, ...]) -> None:
    """allowMultipleAllocations and any capacity's requestPolicy are consumable capacity's
    fields; counters and taints are not."""
    assert share_fields(dropped) == shares
