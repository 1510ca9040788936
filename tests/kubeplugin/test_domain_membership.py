"""Compute-domain membership against a real kube-apiserver: each node announces itself on its
own Node, a domain forms once every seat is held, every member gives its agent the same node
list by seat, a lost or leaving node empties its seat only, a replacement takes that seat and
a lost node back holds none, and each node writes its own Node a fixed number of times
whatever the domain's size.

The agent here records what membership tells it (the node list) and answers a domain state;
the real agent and its IMEX daemons are met in tests/k8s/test_compute_domains.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.kubeplugin.claims import ClaimError, KubeletClaim
from agent.kubeplugin.domain_members import DOMAIN_LABEL, MEMBER_ANNOTATION, DomainClaim
from agent.kubeplugin.domains import DomainMembership
from agent.kubeplugin.kube import KubeClient
from tests.k8s.harness import ApiServer, schedulable_node
from tests.kubeplugin.publishing import eventually, kube_client, sample


@dataclass
class RecordingAgent:
    """The agent's side of membership: its IMEX address, the node lists it was given, and
    the domain state its IMEX daemon would report (and the node list, as the agent shows it)."""

    address: str
    lists: list[list[str | None]] = field(default_factory=list)
    state: str = "UP"

    async def imex_address(self) -> str | None:
        return self.address

    async def configure_domain(self, domain: str, peers: list[str | None]) -> None:
        assert self.address in peers, "the agent refuses a list without its own address"
        self.lists.append(peers)

    async def leave_domain(self, domain: str) -> None:
        self.lists.clear()

    async def domain(self, domain: str) -> dict[str, Any] | None:
        if not self.lists:
            return None
        return {"id": domain, "state": self.state, "peers": self.lists[-1]}


@dataclass
class Node:
    name: str
    agent: RecordingAgent
    membership: DomainMembership
    registry: CollectorRegistry

    def writes(self, what: str) -> float:
        return sample(self.registry, "domain_node_writes_total", what=what)


@pytest.fixture
async def cluster(kube_apiserver: ApiServer) -> AsyncIterator[Any]:
    """``make(n)``: n Ready Nodes, each with its membership (its own API client) and agent
    (``suffix``: the one node's name after the cluster's prefix, else its number)."""
    clients: list[KubeClient] = []
    made: list[Node] = []
    prefix = f"dm-{uuid.uuid4().hex[:6]}"

    async def make(count: int, *, form_timeout_s: float = 60.0,
                   suffix: str | None = None) -> list[Node]:
        nodes = []
        for _ in range(count):
            name = f"{prefix}-{suffix or len(made)}"
            await asyncio.to_thread(schedulable_node, kube_apiserver, name)
            kube = await kube_client(kube_apiserver.kubeconfig)
            clients.append(kube)
            agent = RecordingAgent(f"10.1.0.{len(made) + 1}")
            registry = CollectorRegistry()
            node = Node(name, agent, DomainMembership(
                kube, agent, node_name=name, registry=registry, form_timeout_s=form_timeout_s,
                check_interval_s=0.1), registry)
            made.append(node)
            nodes.append(node)
        return nodes

    yield make
    for node in made:
        await node.membership.close()
    for kube in clients:
        await kube.close()


def domain(size: int) -> tuple[KubeletClaim, DomainClaim]:
    uid = str(uuid.uuid4())
    claim = KubeletClaim(namespace="team", uid=uid, name="job-domain")
    return claim, DomainClaim(uid, size, ("nodes",), "x/compute-domain")


def node_meta(server: ApiServer, name: str) -> dict[str, Any]:
    status, node = server.request("GET", f"/api/v1/nodes/{name}")
    assert status == 200, node
    return dict(node["metadata"])


def announced(server: ApiServer, name: str) -> dict[str, Any] | None:
    raw = (node_meta(server, name).get("annotations") or {}).get(MEMBER_ANNOTATION)
    return json.loads(raw) if raw else None


def set_ready(server: ApiServer, name: str, status: str) -> None:
    """The Node's Ready condition, as the node lifecycle controller sets it (``Unknown``:
    its kubelet stopped posting) or the kubelet back (``True``)."""
    server.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": {"conditions": [
                       {"type": "Ready", "status": status, "reason": "Test",
                        "message": f"Ready {status}"}]}}))


async def formed(nodes: list[Node], claim: KubeletClaim, wanted: DomainClaim) -> None:
    """Every node joins at once and, prepared, announces Ready."""
    await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    for n in nodes:
        await n.membership.ready(wanted.uid)


async def test_a_domain_forms_with_every_member_and_two_writes_each(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Four nodes join a four-seat domain at once: each waits for the others, then each
    agent gets the same four addresses by seat (seats by node name while forming), once;
    each node wrote its own Node twice (join, then ready with the seat it holds) and nothing
    else."""
    nodes = await cluster(4)
    claim, wanted = domain(4)
    lists = await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    every = tuple(n.agent.address for n in sorted(nodes, key=lambda n: n.name))
    assert all(found == every for found in lists), lists
    for n in nodes:
        await n.membership.ready(wanted.uid)
    for n in nodes:
        assert n.agent.lists == [list(every)]
        assert (n.writes("join"), n.writes("state"), n.writes("leave")) == (1, 1, 0)
        meta = node_meta(kube_apiserver, n.name)
        assert meta["labels"][DOMAIN_LABEL] == wanted.uid
        assert announced(kube_apiserver, n.name) == {"domain": wanted.uid,
                                                     "address": n.agent.address,
                                                     "state": "Ready",
                                                     "seat": every.index(n.agent.address),
                                                     "generation": 0}


async def test_a_domain_short_of_nodes_fails_the_prepare_and_forms_when_they_come(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Two of a three-seat domain's nodes: the prepare fails (retryable) naming how many
    seats are held and who joined; they stay announced, so when the third joins, the
    retries form it."""
    first, second, third = await cluster(3, form_timeout_s=0.5)
    claim, wanted = domain(3)
    failures = await asyncio.gather(first.membership.join(claim, wanted),
                                    second.membership.join(claim, wanted),
                                    return_exceptions=True)
    for failure in failures:
        assert isinstance(failure, ClaimError), failure
        assert failure.reason == "domain-forming" and failure.retryable
        assert "2 of 3 seats are held" in str(failure)
        assert first.name in str(failure) and second.name in str(failure)
    assert announced(kube_apiserver, first.name)["state"] == "Joining"  # type: ignore[index]
    assert first.agent.lists == [] and second.agent.lists == []
    lists = await asyncio.gather(*(n.membership.join(claim, wanted)
                                   for n in (first, second, third)))
    assert len(set(lists)) == 1 and len(lists[0]) == 3
    assert (first.writes("join"), first.writes("state")) == (1, 0)


async def test_a_lost_node_leaves_the_node_list_and_the_members_say_degraded(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """A member whose Node goes NotReady (the node lifecycle controller's doing when its
    kubelet stops) is no longer a peer: the others' agents get the list with its seat empty
    (the others keep theirs). Their IMEX seeing a peer down becomes their announced state,
    Degraded, and Ready again."""
    nodes = await cluster(3)
    claim, wanted = domain(3)
    await formed(nodes, claim, wanted)
    lost, kept = nodes[2], nodes[:2]
    await asyncio.to_thread(set_ready, kube_apiserver, lost.name, "Unknown")
    survivors = [n.agent.address for n in kept] + [None]
    for n in kept:
        await eventually(lambda n=n: n.agent.lists[-1] == survivors)  # type: ignore[misc]
        n.agent.state = "DEGRADED"
    for n in kept:
        await eventually(lambda n=n: (announced(kube_apiserver, n.name) or {}).get(  # type: ignore[misc]
            "state") == "Degraded")
        n.agent.state = "UP"
        await eventually(lambda n=n: (announced(kube_apiserver, n.name) or {}).get(  # type: ignore[misc]
            "state") == "Ready")
        # The counter moves once the patch has returned, just after the server shows it.
        await eventually(lambda n=n: n.writes("state") == 3)  # type: ignore[misc]
        assert n.writes("join") == 1 and n.writes("state") == 3


async def test_a_replacement_takes_the_lost_seat_and_the_lost_node_back_holds_none(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """A node is lost and its pod runs on a new node (named so that node-name order would put
    it between two members): the new node takes the lost one's seat at a higher generation,
    and the others' lists differ from the formed one in that seat only. The lost node back
    Ready holds no seat (the newer generation wins): it gives its agent nothing, and the
    others' lists stay. Each node wrote its Node twice."""
    nodes = await cluster(3)
    claim, wanted = domain(3)
    await formed(nodes, claim, wanted)
    first = [n.agent.address for n in nodes]
    lost, kept = nodes[2], nodes[:2]
    await asyncio.to_thread(set_ready, kube_apiserver, lost.name, "Unknown")
    for n in kept:
        await eventually(lambda n=n: n.agent.lists[-1] == [*first[:2], None])  # type: ignore[misc]
    (new,) = await cluster(1, suffix="0-new")
    assert nodes[0].name < new.name < nodes[1].name
    replaced = [*first[:2], new.agent.address]
    assert await new.membership.join(claim, wanted) == tuple(replaced)
    await new.membership.ready(wanted.uid)
    assert announced(kube_apiserver, new.name) == {
        "domain": wanted.uid, "address": new.agent.address, "state": "Ready", "seat": 2,
        "generation": 1}
    for n in kept:
        await eventually(lambda n=n: n.agent.lists[-1] == replaced)  # type: ignore[misc]
        assert n.agent.lists == [first, [*first[:2], None], replaced]
    assert lost.agent.lists == [first], "a lost node gives its agent no list without itself"
    await asyncio.to_thread(set_ready, kube_apiserver, lost.name, "True")
    for n in (*nodes, new):  # every member has seen the lost node Ready again
        await eventually(lambda n=n: any(  # type: ignore[misc]
            m.node == lost.name and m.node_ready
            for m in n.membership.members_of(wanted.uid)))
    assert lost.membership.seat(wanted.uid) is None
    assert [n.membership.seat(wanted.uid) for n in (*kept, new)] == [0, 1, 2]
    for n in (*kept, new):
        assert n.agent.lists[-1] == replaced
    assert lost.agent.lists == [first]
    for n in (*nodes, new):
        assert (n.writes("join"), n.writes("state"), n.writes("leave")) == (1, 1, 0)


async def test_a_node_beside_a_full_domain_holds_no_seat(kube_apiserver: ApiServer,
                                                         cluster: Any) -> None:
    """A third node joins a formed two-seat domain: it holds no seat, so its prepare fails
    (retryable) saying so, its agent gets nothing and the members' lists stay."""
    nodes = await cluster(2)
    claim, wanted = domain(2)
    await formed(nodes, claim, wanted)
    (extra,) = await cluster(1, form_timeout_s=0.5)
    with pytest.raises(ClaimError, match="this node holds no seat") as err:
        await extra.membership.join(claim, wanted)
    assert err.value.reason == "domain-forming" and err.value.retryable
    assert extra.agent.lists == []
    every = [n.agent.address for n in nodes]
    assert all(n.agent.lists == [every] for n in nodes)


async def test_leaving_takes_the_membership_off_the_node_and_out_of_the_list(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Unprepare on a node takes its label and annotation off (one write) and the others'
    agents get the list with its seat empty, theirs kept (written in their Ready patches:
    seat 0 is left free though name order would fill it); a node that was no member writes
    nothing."""
    nodes = await cluster(3)
    claim, wanted = domain(3)
    await formed(nodes, claim, wanted)
    leaving = nodes[0]
    await leaving.membership.leave(wanted.uid)
    meta = node_meta(kube_apiserver, leaving.name)
    assert DOMAIN_LABEL not in (meta.get("labels") or {})
    assert MEMBER_ANNOTATION not in (meta.get("annotations") or {})
    assert leaving.writes("leave") == 1 and not leaving.membership.joined(wanted.uid)
    rest = [None] + [n.agent.address for n in nodes[1:]]
    for n in nodes[1:]:
        await eventually(lambda n=n: n.agent.lists[-1] == rest)  # type: ignore[misc]
    await leaving.membership.leave(wanted.uid)
    assert leaving.writes("leave") == 1


async def test_a_node_is_in_one_domain_at_a_time(cluster: Any) -> None:
    (only,) = await cluster(1)
    claim, first = domain(1)
    await only.membership.join(claim, first)
    other_claim, other = domain(1)
    with pytest.raises(ClaimError, match=f"member of compute domain {first.uid}") as err:
        await only.membership.join(other_claim, other)
    assert err.value.reason == "domain-busy"


async def test_a_restarted_plugin_follows_the_domain_its_node_announces(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """The plugin restarts while its node is a member: the new membership reads the Node,
    follows the domain (a member leaving still reaches its agent) and can leave it."""
    nodes = await cluster(2)
    claim, wanted = domain(2)
    await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    restarted = nodes[0]
    await restarted.membership.close()
    kube = await kube_client(kube_apiserver.kubeconfig)
    try:
        again = DomainMembership(kube, restarted.agent, node_name=restarted.name,
                                 registry=CollectorRegistry(), check_interval_s=0.1)
        await again.recover()
        assert again.joined(wanted.uid)
        await nodes[1].membership.leave(wanted.uid)
        await eventually(lambda: restarted.agent.lists[-1] == [restarted.agent.address, None])
        await again.leave(wanted.uid)
        assert DOMAIN_LABEL not in (node_meta(kube_apiserver, restarted.name).get("labels")
                                    or {})
        await again.close()
    finally:
        await kube.close()
