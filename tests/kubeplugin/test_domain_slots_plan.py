"""What the plugin writes for the node's compute-domain slot (pure: the agent's slot, the Node
and the server's slice in, steps out): the label before the slice, the slice deleted before
the label goes, nothing when all is as wanted, the generation one above the server's."""

from __future__ import annotations

from typing import Any

import pytest

from agent.kubeplugin.domain_slots import SetLabel, Step, Write, decide, in_sync
from agent.kubeplugin.resource_slice_plan import is_slot

D = "gpu.nodeagent.dev"
LABEL = f"{D}/fabric-clique"
CLIQUE = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2.7"
Json = dict[str, Any]


def slot(clique: str = CLIQUE, name: str = "tray-03-compute-domain") -> Json:
    """The agent's slot, as /v1/resourceslices answers it."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": D, "pool": {"name": "tray-03/compute-domain", "generation": 0,
                                           "resourceSliceCount": 1},
                     "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": LABEL, "operator": "In", "values": [clique]}]}]},
                     "devices": [{"name": "slot", "attributes": {
                         "type": {"string": "compute-domain-slot"},
                         "fabricClique": {"string": clique}}}]}}


def node(label: str | None = None) -> Json:
    labels = {"kubernetes.io/hostname": "tray-03"}
    if label is not None:
        labels[LABEL] = label
    return {"metadata": {"name": "tray-03", "uid": "node-uid", "labels": labels}}


def stored(clique: str = CLIQUE, *, generation: int = 4, uid: str = "node-uid") -> Json:
    """The slice as the server holds it (its own fields added)."""
    body = slot(clique)
    body["metadata"] = {**body["metadata"], "uid": "slice-uid", "resourceVersion": "77",
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                             "name": "tray-03", "uid": uid,
                                             "controller": True}]}
    body["spec"]["pool"]["generation"] = generation
    return body


def kinds(steps: list[Step]) -> list[Any]:
    return [(type(s).__name__, s.value if isinstance(s, SetLabel) else
             s.create if isinstance(s, Write) else s.resource_version) for s in steps]


TABLE = [
    ("new: label, then create", slot(), node(), None, [("SetLabel", CLIQUE), ("Write", True)]),
    ("labelled, no slice: create", slot(), node(CLIQUE), None, [("Write", True)]),
    ("all as wanted: nothing", slot(), node(CLIQUE), stored(), []),
    ("label removed by someone: put back", slot(), node(), stored(), [("SetLabel", CLIQUE)]),
    ("clique changed: relabel, update", slot("other.1"), node(CLIQUE), stored(),
     [("SetLabel", "other.1"), ("Write", False)]),
    ("owned by an old Node: update", slot(), node(CLIQUE), stored(uid="old"),
     [("Write", False)]),
    ("withdrawn: delete, then unlabel", None, node(CLIQUE), stored(),
     [("Delete", "77"), ("SetLabel", None)]),
    ("withdrawn, slice gone: unlabel", None, node(CLIQUE), None, [("SetLabel", None)]),
    ("withdrawn, nothing left: nothing", None, node(), None, []),
    ("a slot of another name: withdrawn", slot(name="other-compute-domain"), node(CLIQUE),
     stored(), [("Delete", "77"), ("SetLabel", None)]),
]


@pytest.mark.parametrize(("wanted", "node_", "existing", "expected"),
                         [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_decide(wanted: Json | None, node_: Json, existing: Json | None,
                expected: list[Any]) -> None:
    assert kinds(decide(wanted, node=node_, existing=existing, driver=D)) == expected


def test_a_write_is_owned_by_the_node_one_generation_above_the_server() -> None:
    (update,) = decide(slot("other.1"), node=node("other.1"), existing=stored(generation=4),
                       driver=D)
    assert isinstance(update, Write)
    body = update.body
    assert body["metadata"] == {"name": "tray-03-compute-domain", "resourceVersion": "77",
                                "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                     "name": "tray-03", "uid": "node-uid",
                                                     "controller": True}]}
    assert body["spec"]["pool"] == {"name": "tray-03/compute-domain", "generation": 5,
                                    "resourceSliceCount": 1}
    assert body["spec"]["nodeSelector"] == slot("other.1")["spec"]["nodeSelector"]
    (create,) = decide(slot(), node=node(CLIQUE), existing=None, driver=D)
    assert isinstance(create, Write) and create.body["spec"]["pool"]["generation"] == 1
    assert "resourceVersion" not in create.body["metadata"]


def test_fields_the_server_adds_are_no_difference_but_a_field_it_lacks_is() -> None:
    server = stored()
    server["spec"]["devices"][0]["extra"] = "defaulted"
    assert in_sync(slot(), server, node_name="tray-03", node_uid="node-uid")
    server["spec"]["devices"][0]["attributes"].pop("fabricClique")
    assert not in_sync(slot(), server, node_name="tray-03", node_uid="node-uid")
    stray = stored()
    stray["spec"]["nodeName"] = "tray-03"
    assert not in_sync(slot(), stray, node_name="tray-03", node_uid="node-uid")


def test_the_slot_is_told_from_the_gpus_slices() -> None:
    assert is_slot(slot())
    assert not is_slot({"spec": {"nodeName": "tray-03", "devices": []}})
    assert not is_slot({"metadata": {}})
