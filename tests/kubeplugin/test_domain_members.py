"""A compute domain read from the API server's objects (pure): the claim's slots, a member's
annotation and the node list every member computes alike."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.kubeplugin.claims import ClaimError, KubeletClaim
from agent.kubeplugin.domain_members import (
    DOMAIN_LABEL,
    MEMBER_ANNOTATION,
    DomainClaim,
    Member,
    domain_claim,
    member_annotation,
    member_of,
    members,
    peers,
)

DRIVER = "gpu.nodeagent.dev"
CLAIM = KubeletClaim(namespace="team", uid="uid-1", name="job-domain")


def allocated(*results: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"uid": "uid-1"},
            "status": {"allocation": {"devices": {"results": list(results)}}}}


def slot(node: str, request: str = "nodes") -> dict[str, Any]:
    return {"driver": DRIVER, "pool": f"{node}/compute-domain", "device": "slot",
            "request": request}


@pytest.mark.parametrize(("results", "want"), [
    pytest.param([slot("n1"), slot("n2"), slot("n3")],
                 DomainClaim("uid-1", 3, ("nodes",), "n1/compute-domain"),
                 id="three slots: a domain of three"),
    pytest.param([{"driver": DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpus"}], None,
                 id="GPUs only: no domain"),
    pytest.param([{**slot("n1"), "driver": "other.example.com"}], None,
                 id="another driver's slot: not ours"),
    pytest.param([{**slot("n1"), "device": "gpu-0"}], None, id="a device not named slot"),
    pytest.param([{**slot("n1"), "pool": "n1"}], None, id="a slot outside a domain pool"),
    pytest.param([slot("n1"), {"driver": "other.example.com", "pool": "p", "device": "nic",
                               "request": "nic"}],
                 DomainClaim("uid-1", 1, ("nodes",), "n1/compute-domain"),
                 id="another driver's device beside the slots is not ours to mind"),
])
def test_domain_claim(results: list[dict[str, Any]], want: DomainClaim | None) -> None:
    assert domain_claim(CLAIM, allocated(*results), driver=DRIVER) == want


def test_slots_and_gpus_of_one_claim_are_refused() -> None:
    """A domain spans a clique and GPUs sit on one node: one claim cannot be both."""
    obj = allocated(slot("n1"), {"driver": DRIVER, "pool": "n1", "device": "gpu-0",
                                 "request": "gpus"})
    with pytest.raises(ClaimError, match="slots and other devices") as err:
        domain_claim(CLAIM, obj, driver=DRIVER)
    assert err.value.reason == "bad-allocation"


def node(name: str, *, domain: str | None = "d1", annotation: str | None = None,
         ready: str | None = "True") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {}, "annotations": {}}
    if domain is not None:
        meta["labels"][DOMAIN_LABEL] = domain
    if annotation is not None:
        meta["annotations"][MEMBER_ANNOTATION] = annotation
    status = {} if ready is None else {"conditions": [{"type": "Ready", "status": ready}]}
    return {"metadata": meta, "status": status}


ANNOUNCED = member_annotation("d1", "10.0.0.1", "Joining")


@pytest.mark.parametrize(("obj", "want"), [
    pytest.param(node("a", annotation=ANNOUNCED), Member("a", "10.0.0.1", "Joining", True),
                 id="labelled and announced"),
    pytest.param(node("a", annotation=ANNOUNCED, ready="Unknown"),
                 Member("a", "10.0.0.1", "Joining", False), id="a lost node is no peer"),
    pytest.param(node("a", annotation=ANNOUNCED, ready=None),
                 Member("a", "10.0.0.1", "Joining", True), id="no conditions: not known lost"),
    pytest.param(node("a", domain="d2", annotation=ANNOUNCED), None, id="labelled for another"),
    pytest.param(node("a", domain=None, annotation=ANNOUNCED), None, id="not labelled"),
    pytest.param(node("a"), None, id="labelled, not yet announced"),
    pytest.param(node("a", annotation="{not json"), None, id="annotation not JSON"),
    pytest.param(node("a", annotation=member_annotation("d2", "10.0.0.1", "Ready")), None,
                 id="annotation of another domain"),
    pytest.param(node("a", annotation=json.dumps({"domain": "d1", "address": "",
                                                  "state": "Ready"})), None, id="no address"),
    pytest.param(node("a", annotation=json.dumps({"domain": "d1", "address": "10.0.0.1",
                                                  "state": "Happy"})), None,
                 id="a state that is none of ours"),
])
def test_member_of(obj: dict[str, Any], want: Member | None) -> None:
    assert member_of(obj, "d1") == want


def test_every_member_computes_one_node_list() -> None:
    """Members by node name, the lost ones left out, each address once: the same list
    whichever order the server lists the Nodes in."""
    nodes = [node(name, annotation=member_annotation("d1", address, "Ready"), ready=ready)
             for name, address, ready in (("c", "10.0.0.3", "True"), ("a", "10.0.0.1", "True"),
                                          ("d", "10.0.0.4", "False"),
                                          ("b", "10.0.0.2", "True"),
                                          ("e", "10.0.0.2", "True"))]
    for order in (nodes, list(reversed(nodes))):
        found = members(order, "d1")
        assert [m.node for m in found] == ["a", "b", "c", "d", "e"]
        assert peers(found) == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
