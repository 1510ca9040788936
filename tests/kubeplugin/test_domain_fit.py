"""Why a compute-domain claim cannot be placed (agent/kubeplugin/domain_fit.py): its size
from its requests, the slots each clique offers from the driver's slices, and the reason
naming the largest clique when no clique has room."""

from __future__ import annotations

from typing import Any

import pytest

from agent.kubeplugin.domain_fit import domain_size, slots_by_clique, unfit_reason

DRIVER = "gpu.nodeagent.dev"
CLASS = f"compute-domain.{DRIVER}"


def claim(*requests: dict[str, Any], allocated: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "c", "namespace": "n", "uid": "u"},
                            "spec": {"devices": {"requests": list(requests)}}}
    if allocated:
        body["status"] = {"allocation": {"devices": {"results": []}}}
    return body


def request(count: Any = 3, cls: str = CLASS, mode: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, "count": count}
    if mode is not None:
        exactly["allocationMode"] = mode
    return {"name": "nodes", "exactly": exactly}


@pytest.mark.parametrize(("body", "size"), [
    pytest.param(claim(request(20)), 20, id="a domain of 20"),
    pytest.param(claim(request(3, mode="ExactCount")), 3, id="ExactCount said"),
    pytest.param(claim({"name": "nodes", "exactly": {"deviceClassName": CLASS}}), 1,
                 id="count defaults to 1"),
    pytest.param(claim(request(2), request(2)), 4, id="two requests of the class"),
    pytest.param(claim(request(4, cls="gpu.nodeagent.dev")), None, id="GPUs, not a domain"),
    pytest.param(claim(request(20), allocated=True), None, id="already allocated"),
    pytest.param(claim(request(mode="All")), None, id="All has no size"),
    pytest.param(claim(request(0)), None, id="count 0"),
    pytest.param(claim(request(True)), None, id="count a bool"),
    pytest.param(claim(request("3")), None, id="count a string"),
    pytest.param(claim({"name": "x", "firstAvailable": []}), None, id="no exactly"),
    pytest.param({"metadata": {}}, None, id="no spec"),
])
def test_a_claims_domain_size(body: dict[str, Any], size: int | None) -> None:
    assert domain_size(body, DRIVER) == size


def slot(node: str, clique: str, *, driver: str = DRIVER, device: str = "slot",
         pool_suffix: str = "/compute-domain") -> dict[str, Any]:
    return {"spec": {"driver": driver, "pool": {"name": node + pool_suffix},
                     "devices": [{"name": device}],
                     "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [{
                         "key": f"{DRIVER}/fabric-clique", "operator": "In",
                         "values": [clique]}]}]}}}


def test_slots_are_counted_by_clique_and_other_slices_are_not() -> None:
    slices = [slot("a-0", "A.1"), slot("a-1", "A.1"), slot("b-0", "B.1"),
              slot("x", "A.1", driver="other.example.com"), slot("y", "A.1", device="gpu-0"),
              slot("z", "A.1", pool_suffix=""), {"spec": {"driver": DRIVER}}, {}]
    assert slots_by_clique(slices, DRIVER) == {"A.1": 2, "B.1": 1}


@pytest.mark.parametrize(("size", "slots", "says"), [
    pytest.param(16, {"A.1": 18, "B.1": 2}, None, id="fits the largest"),
    pytest.param(18, {"A.1": 18}, None, id="exactly the largest"),
    pytest.param(20, {"A.1": 18, "B.1": 2},
                 "asks for a compute domain of 20 nodes in one NVLink clique, but the largest "
                 "clique, A.1, has 18 nodes offering a slot; 2 more in 1 other clique: a "
                 "domain cannot span cliques", id="the issue's 20 of 18 + 2"),
    pytest.param(2, {"A.1": 1}, "asks for a compute domain of 2 nodes in one NVLink clique, "
                 "but the largest clique, A.1, has 1 node offering a slot: a domain cannot "
                 "span cliques", id="one clique of one"),
    pytest.param(5, {"A.1": 2, "B.1": 2, "C.1": 1},
                 "asks for a compute domain of 5 nodes in one NVLink clique, but the largest "
                 "clique, B.1, has 2 nodes offering a slot; 3 more in 2 other cliques: a "
                 "domain cannot span cliques", id="a tie names one of them"),
    pytest.param(1, {}, "asks for a compute domain of 1 node, but no node offers a "
                 "compute-domain slot (no node has all its GPUs registered in one NVLink "
                 "clique)", id="no slot anywhere"),
])
def test_the_reason_names_the_largest_clique(size: int, slots: dict[str, int],
                                             says: str | None) -> None:
    assert unfit_reason(size, slots) == says
