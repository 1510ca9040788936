"""Compute-domain membership against a real kube-apiserver: each node announces itself on its
own Node, a domain forms once as many Ready nodes as it has slots have joined, every member
gives its agent the same node list, a lost or leaving node leaves that list, and each node
writes its own Node a fixed number of times whatever the domain's size.

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
    the domain state its IMEX daemon would report."""

    address: str
    lists: list[list[str]] = field(default_factory=list)
    state: str = "UP"

    async def imex_address(self) -> str | None:
        return self.address

    async def configure_domain(self, domain: str, peers: list[str]) -> None:
        self.lists.append(peers)

    async def leave_domain(self, domain: str) -> None:
        self.lists.clear()

    async def domain(self, domain: str) -> dict[str, Any] | None:
        return {"id": domain, "state": self.state} if self.lists else None


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
    """``make(n)``: n Ready Nodes, each with its membership (its own API client) and agent."""
    clients: list[KubeClient] = []
    made: list[Node] = []
    prefix = f"dm-{uuid.uuid4().hex[:6]}"

    async def make(count: int, *, form_timeout_s: float = 60.0) -> list[Node]:
        nodes = []
        for _ in range(count):
            name = f"{prefix}-{len(made)}"
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


async def test_a_domain_forms_with_every_member_and_two_writes_each(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Four nodes join a four-slot domain at once: each waits for the others, then each
    agent gets the same four addresses, once; each node wrote its own Node twice (join,
    ready) and nothing else."""
    nodes = await cluster(4)
    claim, wanted = domain(4)
    lists = await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    every = tuple(n.agent.address for n in nodes)
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
                                                     "state": "Ready"}


async def test_a_domain_short_of_nodes_fails_the_prepare_and_forms_when_they_come(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Two of a three-slot domain's nodes: the prepare fails (retryable) naming how many
    joined and which; they stay announced, so when the third joins, the retries form it."""
    first, second, third = await cluster(3, form_timeout_s=0.5)
    claim, wanted = domain(3)
    failures = await asyncio.gather(first.membership.join(claim, wanted),
                                    second.membership.join(claim, wanted),
                                    return_exceptions=True)
    for failure in failures:
        assert isinstance(failure, ClaimError), failure
        assert failure.reason == "domain-forming" and failure.retryable
        assert "2 of 3 nodes have joined" in str(failure)
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
    kubelet stops) is no longer a peer: the others' agents get the list without it. Their
    IMEX seeing a peer down becomes their announced state, Degraded, and Ready again."""
    nodes = await cluster(3)
    claim, wanted = domain(3)
    await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    for n in nodes:
        await n.membership.ready(wanted.uid)
    lost, kept = nodes[2], nodes[:2]
    await asyncio.to_thread(
        kube_apiserver.kubectl, "patch", "node", lost.name, "--subresource=status",
        "--type=merge", "-p", json.dumps({"status": {"conditions": [
            {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "message": "Kubelet stopped posting node status."}]}}))
    survivors = [n.agent.address for n in kept]
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


async def test_leaving_takes_the_membership_off_the_node_and_out_of_the_list(
        kube_apiserver: ApiServer, cluster: Any) -> None:
    """Unprepare on a node takes its label and annotation off (one write) and the others'
    agents get the list without it; a node that was no member writes nothing."""
    nodes = await cluster(3)
    claim, wanted = domain(3)
    await asyncio.gather(*(n.membership.join(claim, wanted) for n in nodes))
    leaving = nodes[0]
    await leaving.membership.leave(wanted.uid)
    meta = node_meta(kube_apiserver, leaving.name)
    assert DOMAIN_LABEL not in (meta.get("labels") or {})
    assert MEMBER_ANNOTATION not in (meta.get("annotations") or {})
    assert leaving.writes("leave") == 1 and not leaving.membership.joined(wanted.uid)
    rest = [n.agent.address for n in nodes[1:]]
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
        await eventually(lambda: restarted.agent.lists[-1] == [restarted.agent.address])
        await again.leave(wanted.uid)
        assert DOMAIN_LABEL not in (node_meta(kube_apiserver, restarted.name).get("labels")
                                    or {})
        await again.close()
    finally:
        await kube.close()
