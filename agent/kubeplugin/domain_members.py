"""A compute domain as the API server holds it (pure): the domain claim's slots, and the
member nodes each node announces on its own Node object.

A domain is one ResourceClaim shared by the pods of a job: its allocation is ``size`` slot
devices (``slot`` in the pools ``<node>/compute-domain``) of one clique, and its
``nodeSelector`` keeps every pod on that clique. A slot stands for a place in the domain,
not for a node: the pods may run on any node of the clique, so the members are the nodes
that prepared the claim, not the nodes whose slots were allocated.

Each member writes only its own Node: the label :data:`DOMAIN_LABEL` (the claim's UID, which
every member lists by) and the annotation :data:`MEMBER_ANNOTATION` (its IMEX address and
its state). No object is written by all members, so a member's write never conflicts with
another's, and the writes per node do not grow with the domain (NVIDIA's driver keeps one
status object per domain that every node updates, with lost writes and 409 storms at scale).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agent.device_names import SLOT_DEVICE, SLOT_POOL_SUFFIX
from agent.kubeplugin.claims import ClaimError, KubeletClaim, allocation_results

#: The UID of the domain a node is a member of (one at a time).
DOMAIN_LABEL = "gpu.nodeagent.dev/compute-domain"
#: The member's record: ``{"domain", "address", "state"}`` as JSON.
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


def member_annotation(domain: str, address: str, state: MemberState) -> str:
    """The value of :data:`MEMBER_ANNOTATION` a node writes on itself."""
    return json.dumps({"domain": domain, "address": address, "state": state},
                      separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class Member:
    """One node of a domain as its Node object says: its IMEX address, the state it
    announced, and whether the Node is Ready (a lost node is not a peer)."""

    node: str
    address: str
    state: MemberState
    node_ready: bool


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
    return Member(node=str(meta.get("name", "")), address=address, state=state,
                  node_ready=_node_ready(node))


def members(nodes: Iterable[Mapping[str, Any]], domain: str) -> tuple[Member, ...]:
    """The members of ``domain`` among ``nodes``, by node name."""
    found = (member_of(node, domain) for node in nodes)
    return tuple(sorted((m for m in found if m is not None), key=lambda m: m.node))


def peers(found: Sequence[Member]) -> tuple[str, ...]:
    """The IMEX node list: the addresses of the members whose Node is Ready, in node-name
    order (every member computes the same list from the same Nodes), each once."""
    return tuple(dict.fromkeys(m.address for m in found if m.node_ready))
