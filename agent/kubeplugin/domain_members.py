"""A compute domain as the API server holds it (pure): the domain claim's slots, and the
member nodes each node announces on its own Node object.

A domain is one ResourceClaim shared by the pods of a job: its allocation is ``size`` slot
devices (``slot`` in the pools ``<node>/compute-domain``) of one clique, and its
``nodeSelector`` keeps every pod on that clique. A slot stands for a place in the domain,
not for a node: the pods may run on any node of the clique, so the members are the nodes
that prepared the claim, not the nodes whose slots were allocated.

Each member writes only its own Node: the label :data:`DOMAIN_LABEL` (the claim's UID, which
every member lists by) and the annotation :data:`MEMBER_ANNOTATION` (its IMEX address, its
state, and its seat with the seat's generation). No object is written by all members, so a
member's write never conflicts with another's, and the writes per node do not grow with the
domain (NVIDIA's driver keeps one status object per domain that every node updates, with lost
writes and 409 storms at scale).

A domain of ``size`` has seats ``0..size-1``, one IMEX node index each: a member keeps its
seat while its Node is Ready, so a change of members changes the node list only at the seats
that changed hands and IMEX reconnects instead of restarting. :func:`seats` decides who holds
which seat from the members' records alone, the same on every member, without a lock: a
claim on a seat is a record on the claimant's own Node, and a conflict between two records
is settled by a rule every member applies alike (the higher generation, then the lower node
name), not by whichever write came first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from agent.device_names import SLOT_DEVICE, SLOT_POOL_SUFFIX
from agent.kubeplugin.claims import ClaimError, KubeletClaim, allocation_results

#: The UID of the domain a node is a member of (one at a time).
DOMAIN_LABEL = "gpu.nodeagent.dev/compute-domain"
#: The member's record: ``{"domain", "address", "state", "seat", "generation"}`` as JSON
#: (``seat`` and ``generation`` absent while the member holds no seat of its own record).
MEMBER_ANNOTATION = "gpu.nodeagent.dev/compute-domain-member"

MemberState = Literal["Joining", "Ready", "Degraded", "NotReady"]
MEMBER_STATES: tuple[MemberState, ...] = ("Joining", "Ready", "Degraded", "NotReady")
#: The agent's IMEX domain state (``nvidia-imex-ctl -N``'s Domain State) as a member's state.
IMEX_STATES: Mapping[str, MemberState] = {"UP": "Ready", "DEGRADED": "Degraded",
                                          "DOWN": "NotReady"}


@dataclass(frozen=True)
class DomainClaim:
    """A claim whose allocation is a compute domain: ``size`` slots of one clique."""

    uid: str
    size: int
    requests: tuple[str, ...]
    """The claim's requests the slots serve (what kubelet's answer names)."""
    pool: str
    """The pool of the first slot (kubelet's answer names one device for the domain)."""


def _is_slot(result: Mapping[str, Any]) -> bool:
    """An allocation result (of this driver) naming a node's compute-domain slot."""
    pool = result.get("pool")
    return (result.get("device") == SLOT_DEVICE and isinstance(pool, str)
            and pool.endswith(SLOT_POOL_SUFFIX))


def domain_claim(claim: KubeletClaim, obj: Mapping[str, Any], *,
                 driver: str) -> DomainClaim | None:
    """The domain ``obj`` (an allocated ResourceClaim) asks for; None when it holds no slot.
    :class:`ClaimError` for a claim not allocated or of the wrong shape
    (:func:`allocation_results`), and for one that holds both slots and this driver's other devices
    (a domain is placed on a clique, its GPUs on one node: one claim cannot be both)."""
    ours = [r for r in allocation_results(claim, obj) if r.get("driver") == driver]
    slots = [r for r in ours if _is_slot(r)]
    if not slots:
        return None
    if len(slots) != len(ours):
        raise ClaimError("bad-allocation", f"claim {claim}: holds compute-domain slots and other "
                                           f"devices of {driver}: ask for the domain in a claim "
                                           "of its own, shared by the job's pods")
    requests = tuple(dict.fromkeys(str(r.get("request") or "") for r in slots))
    return DomainClaim(uid=claim.uid, size=len(slots), requests=requests,
                       pool=str(slots[0]["pool"]))


def member_annotation(domain: str, address: str, state: MemberState,
                      seat: int | None = None, generation: int = 0) -> str:
    """The value of :data:`MEMBER_ANNOTATION` a node writes on itself (``seat`` None: no
    seat claimed, as while joining)."""
    record: dict[str, Any] = {"domain": domain, "address": address, "state": state}
    if seat is not None:
        record.update(seat=seat, generation=generation)
    return json.dumps(record, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class Member:
    """One node of a domain as its Node object says: its IMEX address, the state it
    announced, whether the Node is Ready (a lost node is not a peer), and the seat it
    claims with that seat's generation (None: no claim, as while joining)."""

    node: str
    address: str
    state: MemberState
    node_ready: bool
    seat: int | None = None
    generation: int = 0


def _count(value: Any) -> int | None:
    """A non-negative JSON integer (a bool is no seat), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _node_ready(node: Mapping[str, Any]) -> bool:
    """The Node's ``Ready`` condition is True (no conditions at all: not known to be lost)."""
    conditions = (node.get("status") or {}).get("conditions")
    if not isinstance(conditions, list):
        return True
    for condition in conditions:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return True


def member_of(node: Mapping[str, Any], domain: str) -> Member | None:
    """The member ``node`` is of ``domain``, or None: not labelled for it, or its annotation
    names another domain, has no address, or is not JSON (a node still joining, or written
    by something else)."""
    meta = node.get("metadata") or {}
    if (meta.get("labels") or {}).get(DOMAIN_LABEL) != domain:
        return None
    raw = (meta.get("annotations") or {}).get(MEMBER_ANNOTATION)
    try:
        record = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    if not isinstance(record, Mapping) or record.get("domain") != domain:
        return None
    address, state = record.get("address"), record.get("state")
    if not isinstance(address, str) or not address or state not in MEMBER_STATES:
        return None
    # A record without a seat (written before seats, or joining) claims none; a seat that
    # is no count is no claim either (the member is then seated like a joining one).
    seat = _count(record.get("seat"))
    generation = _count(record.get("generation")) if seat is not None else None
    return Member(node=str(meta.get("name", "")), address=address, state=state,
                  node_ready=_node_ready(node), seat=seat, generation=generation or 0)


def members(nodes: Iterable[Mapping[str, Any]], domain: str) -> tuple[Member, ...]:
    """The members of ``domain`` among ``nodes``, by node name."""
    found = (member_of(node, domain) for node in nodes)
    return tuple(sorted((m for m in found if m is not None), key=lambda m: m.node))


def seats(found: Iterable[Member], size: int) -> dict[int, Member]:
    """Who holds which of the ``size`` seats: the same answer on every member from the same
    records, whatever their order. Only members whose Node is Ready hold seats (a lost
    node's seat is free).

    1. A seat claimed in a record (``seat < size``) goes to the claim of the highest
       generation, ties to the lowest node name: a member that took a lost node's seat
       (a higher generation) keeps it when the lost node comes back.
    2. The members left (no claim, or a claim that lost), by node name, take the free seats
       lowest first, each seat at generation one above the highest any record has for it
       (also a lost node's: so the taker's claim, once written, beats the lost node's),
       0 for a seat no record names. Those left then hold no seat.

    The returned members carry the seat and generation they hold (a taken seat is what the
    member writes in its record when it next announces itself)."""
    ordered = sorted(found, key=lambda m: m.node)
    held: dict[int, Member] = {}
    for member in ordered:  # by name: on a tie the first (lowest) name stays
        if not member.node_ready or member.seat is None or member.seat >= size:
            continue
        holder = held.get(member.seat)
        if holder is None or member.generation > holder.generation:
            held[member.seat] = member
    seated = {m.node for m in held.values()}
    highest: dict[int, int] = {}
    for member in ordered:
        if member.seat is not None:
            highest[member.seat] = max(highest.get(member.seat, -1), member.generation)
    free = (seat for seat in range(size) if seat not in held)
    for member, seat in zip((m for m in ordered if m.node_ready and m.node not in seated),
                            free, strict=False):
        held[seat] = replace(member, seat=seat, generation=highest.get(seat, -1) + 1)
    return dict(sorted(held.items()))


def node_list(held: Mapping[int, Member], size: int) -> tuple[str | None, ...]:
    """The IMEX node list by seat: the holder's address at its seat, None at a free one. An
    address already at a lower seat is not listed twice (two nodes configured with one IMEX
    address: the agent refuses a list naming one twice)."""
    listed: list[str | None] = []
    for seat in range(size):
        member = held.get(seat)
        address = member.address if member is not None else None
        listed.append(address if address not in listed else None)
    return tuple(listed)


def seat_of(held: Mapping[int, Member], node: str) -> Member | None:
    """The seat ``node`` holds in ``held`` (the member, with seat and generation), or None."""
    return next((m for m in held.values() if m.node == node), None)
