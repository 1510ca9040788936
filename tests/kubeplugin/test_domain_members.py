"""A compute domain read from the API server's objects (pure): the claim's slots, a member's
annotation, and the seats and node list every member computes alike from the members'
records."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    node_list,
    seat_of,
    seats,
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
    pytest.param(node("a", annotation=member_annotation("d1", "10.0.0.1", "Ready", 2, 5)),
                 Member("a", "10.0.0.1", "Ready", True, 2, 5), id="a seat and its generation"),
    pytest.param(node("a", annotation=member_annotation("d1", "10.0.0.1", "Ready", 0)),
                 Member("a", "10.0.0.1", "Ready", True, 0, 0), id="seat 0, generation 0"),
    pytest.param(node("a", annotation=json.dumps({"domain": "d1", "address": "10.0.0.1",
                                                  "state": "Ready", "seat": 1})),
                 Member("a", "10.0.0.1", "Ready", True, 1, 0), id="no generation: 0"),
    *(pytest.param(node("a", annotation=json.dumps({"domain": "d1", "address": "10.0.0.1",
                                                    "state": "Ready", "seat": bad,
                                                    "generation": 3})),
                   Member("a", "10.0.0.1", "Ready", True), id=f"seat {bad!r}: no claim")
      for bad in (-1, "1", True, 1.5, None)),
])
def test_member_of(obj: dict[str, Any], want: Member | None) -> None:
    assert member_of(obj, "d1") == want


def test_the_annotation_claims_no_seat_while_joining() -> None:
    """A joining member writes no seat (its seat is taken by name order until it is Ready);
    one written before seats existed reads the same."""
    assert json.loads(member_annotation("d1", "10.0.0.1", "Joining")) == {
        "domain": "d1", "address": "10.0.0.1", "state": "Joining"}
    assert json.loads(member_annotation("d1", "10.0.0.1", "Ready", 3, 7)) == {
        "domain": "d1", "address": "10.0.0.1", "state": "Ready", "seat": 3, "generation": 7}


def m(name: str, seat: int | None = None, generation: int = 0, *, ready: bool = True,
      address: str | None = None) -> Member:
    """A member record: Node ``name``, its claim (None: none yet) and its Node's Ready."""
    return Member(name, address or f"10.0.0.{ord(name[0])}", "Ready" if seat is not None
                  else "Joining", ready, seat, generation)


def held_by(found: list[Member], size: int) -> dict[int, tuple[str, int]]:
    """Seat -> (node, generation): what the tables below read as the answer."""
    return {seat: (who.node, who.generation) for seat, who in seats(found, size).items()}


@pytest.mark.parametrize(("found", "size", "want"), [
    pytest.param([m("c"), m("a"), m("b")], 3, {0: ("a", 0), 1: ("b", 0), 2: ("c", 0)},
                 id="forming: seats by node name, generation 0"),
    pytest.param([m("a"), m("b")], 3, {0: ("a", 0), 1: ("b", 0)},
                 id="short of members: seat 2 free"),
    pytest.param([m("a"), m("b"), m("c"), m("d")], 3, {0: ("a", 0), 1: ("b", 0), 2: ("c", 0)},
                 id="more members than seats: the last by name holds none"),
    pytest.param([m("b", 0), m("c", 1), m("d", 2), m("a")], 3,
                 {0: ("b", 0), 1: ("c", 0), 2: ("d", 0)},
                 id="a Ready holder keeps its seat: a lower name joining waits"),
    pytest.param([m("a", 0), m("b", 1), m("c", 2, 4, ready=False), m("z")], 3,
                 {0: ("a", 0), 1: ("b", 0), 2: ("z", 5)},
                 id="a lost node's seat goes to a joiner, a generation above the lost one"),
    pytest.param([m("a", 0), m("b", 1), m("c", 2, 4), m("z", 2, 5)], 3,
                 {0: ("a", 0), 1: ("b", 0), 2: ("z", 5)},
                 id="the lost node back Ready loses to the newer generation"),
    pytest.param([m("a", 0), m("b", 1), m("c", 2, 4), m("z")], 3,
                 {0: ("a", 0), 1: ("b", 0), 2: ("c", 4)},
                 id="the lost node back before the joiner wrote its seat keeps it"),
    pytest.param([m("b", 1, 2), m("a", 1, 2), m("c")], 3,
                 {0: ("b", 0), 1: ("a", 2), 2: ("c", 0)},
                 id="one seat, one generation twice: the lower name; the other takes a free "
                    "seat"),
    pytest.param([m("a", 7), m("b", 3)], 2, {0: ("a", 0), 1: ("b", 0)},
                 id="a seat past the size claims nothing"),
    pytest.param([m("a", 1, 3, ready=False), m("b", 0, 0, ready=False)], 2, {},
                 id="lost nodes hold no seat"),
    pytest.param([m("a", 1, 6, ready=False), m("b", 1, 3), m("c", 0)], 3,
                 {0: ("c", 0), 1: ("b", 3)},
                 id="a lost node's record does not stop a Ready claim of a lower generation"),
    pytest.param([], 2, {}, id="no members"),
])
def test_seats(found: list[Member], size: int, want: dict[int, tuple[str, int]]) -> None:
    assert held_by(found, size) == want
def test_every_member_computes_one_node_list() -> None:
    """Addresses by seat, None at a free one: the same list whichever order the server lists
    the Nodes in. A lost node's seat is free; an address twice is listed once (the agent
    refuses a list naming one twice)."""
    nodes = [node(name, annotation=member_annotation("d1", address, "Ready", seat), ready=ready)
             for name, address, seat, ready in (("c", "10.0.0.3", 0, "True"),
                                                ("a", "10.0.0.1", 3, "True"),
                                                ("d", "10.0.0.4", 1, "False"),
                                                ("b", "10.0.0.2", 2, "True"),
                                                ("e", "10.0.0.2", 4, "True"))]
    for order in (nodes, list(reversed(nodes))):
        found = members(order, "d1")
        assert [x.node for x in found] == ["a", "b", "c", "d", "e"]
        assert node_list(seats(found, 5), 5) == ("10.0.0.3", None, "10.0.0.2", "10.0.0.1",
                                                None)
        assert seat_of(seats(found, 5), "a") == replace(found[0], seat=3)
        assert seat_of(seats(found, 5), "d") is None


# --- properties: any records, on every member, in any order ---------------------------------

NAMES = st.sampled_from("abcdefghij")


@st.composite
def records(draw: st.DrawFn, size: int) -> list[Member]:
    """Members of one domain: distinct nodes, some lost, some claiming seats (also past the
    size, and one seat by several), of small generations so that they meet."""
    names = draw(st.lists(NAMES, unique=True, max_size=8))
    return [Member(name, f"10.0.0.{i}", draw(st.sampled_from(("Joining", "Ready"))),
                   draw(st.booleans()), draw(st.none() | st.integers(0, size + 1)),
                   draw(st.integers(0, 3)))
            for i, name in enumerate(names)]


@st.composite
def domains(draw: st.DrawFn) -> tuple[int, list[Member]]:
    size = draw(st.integers(1, 6))
    return size, draw(records(size))


def written(held: dict[int, Member], found: list[Member]) -> list[Member]:
    """Every seated member writes the seat it holds (its Ready patch); the others' records
    stay."""
    mine = {who.node: who for who in held.values()}
    return [mine.get(x.node, x) for x in found]


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@PROPERTY
@given(domain=domains(), data=st.data())
def test_every_member_computes_the_same_seats(domain: tuple[int, list[Member]],
                                              data: st.DataObject) -> None:
    """The answer depends on the records only, not on the order a member listed them."""
    size, found = domain
    shuffled = data.draw(st.permutations(found))
    assert seats(shuffled, size) == seats(found, size)


@PROPERTY
@given(domain=domains())
def test_no_seat_twice_no_member_twice_only_ready_nodes(domain: tuple[int, list[Member]]
                                                        ) -> None:
    size, found = domain
    held = seats(found, size)
    assert len(held) <= size and all(0 <= seat < size for seat in held)
    assert all(who.seat == seat for seat, who in held.items())
    nodes = [who.node for who in held.values()]
    assert len(nodes) == len(set(nodes))
    by_name = {x.node: x for x in found}
    assert all(by_name[who.node].node_ready for who in held.values())
    ready = sum(x.node_ready for x in found)
    assert len(held) == min(size, ready), "a free seat while a Ready member holds none"
    lst = node_list(held, size)
    assert len(lst) == size and all(lst[s] == held[s].address for s in held)


@PROPERTY
@given(domain=domains())
def test_writing_the_seats_held_changes_none(domain: tuple[int, list[Member]]) -> None:
    """A member's Ready patch writes the seat it holds: after every member has, the answer is
    the same (taking a seat by name order and claiming it agree)."""
    size, found = domain
    held = seats(found, size)
    assert seats(written(held, found), size) == held


@PROPERTY
@given(domain=domains(), joiners=st.lists(st.sampled_from("klmnopq"), unique=True,
                                          min_size=1, max_size=4))
def test_a_ready_holder_keeps_its_seat_whatever_joins(domain: tuple[int, list[Member]],
                                                      joiners: list[str]) -> None:
    """Once the seated members have written their seats, nodes joining (any names) take
    only free seats: every holder keeps its seat and its generation."""
    size, found = domain
    settled = written(seats(found, size), found)
    before = seats(settled, size)
    after = seats(settled + [m(name) for name in joiners], size)
    assert {s: after[s] for s in before} == before


@PROPERTY
@given(domain=domains(), data=st.data())
def test_a_lost_seat_goes_to_a_joiner_and_the_lost_node_back_loses_it(
        domain: tuple[int, list[Member]], data: st.DataObject) -> None:
    """A seated member's Node goes NotReady: a joiner (the only member without a seat)
    takes its seat (the lowest free one) at a higher generation and, once it has written
    it, keeps it when the lost node is Ready again; the lost node then holds no seat."""
    size, found = domain
    settled = written(seats(found, size), found)
    held = seats(settled, size)
    # A seat below which none is free (the joiner takes the lowest free seat).
    candidates = [s for s in sorted(held) if all(t in held for t in range(s))]
    if not candidates:
        return
    seat = data.draw(st.sampled_from(candidates))
    lost = held[seat]
    # Only the seated stay (the joiner must be the one waiting for a seat), the lost one lost.
    others = [replace(x, node_ready=False) if x.node == lost.node else x
              for x in settled if x.node_ready is False or x in held.values()]
    joiner = m("z")
    taken = seats([*others, joiner], size)
    assert taken[seat].node == "z" and taken[seat].generation > lost.generation
    assert {s: taken[s] for s in held if s != seat} == {s: held[s] for s in held if s != seat}
    back = [replace(x, node_ready=True) if x.node == lost.node else x
            for x in written(taken, [*others, joiner])]
    again = seats(back, size)
    assert again[seat].node == "z"
    if len(held) == size:
        assert seat_of(again, lost.node) is None
