"""Compute domains end to end (issue 25): simulated GB200 NVL72 nodes in two NVLink cliques,
each a real agent with its simulated IMEX, a real kubelet plugin and kubelet's DRA manager,
under a real kube-apiserver and kube-scheduler (tests/k8s/domain_bed.py).

A domain job lands on one clique only; every pod's claims are prepared with an IMEX channel
the CDI reference library injects; every member runs IMEX with exactly the job's nodes and
reports the domain UP; faults (an IMEX daemon, an agent, a plugin killed; a member node
lost) recover without a stale node list or a channel held without a claim; a job larger than
any clique stays Pending. The bed here is small (4 + 2 nodes, a 3-node domain); the 18 + 2
rack with 16- and 18-node domains runs in ``python -m bench compute-domains``, which also
counts the API writes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.k8s.domain_bed import (
    BED_GROUP,
    BedSize,
    DomainBed,
    Job,
    Json,
    dumps,
    imex_seats,
    nodes_of,
    start_bed,
)
from tests.k8s.scheduling import unschedulable
from tests.waiting import wait_for

pytestmark = [pytest.mark.xdist_group(BED_GROUP), pytest.mark.slow]

SIZE = BedSize(first=4, second=2)
DOMAIN = 3
CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DomainBed]:
    yield from start_bed(tmp_path_factory.mktemp("domains"), SIZE)


def placed(bed: DomainBed, job: Job) -> dict[str, str]:
    return wait_for(lambda: (found := bed.bound(job)) and len(found) == len(job.pods)
                    and found, f"every pod of {job.claim} bound", 60) or {}


def domain_up(bed: DomainBed, job: Job, members: list[str], *,
              state: str = "UP") -> bool:
    """Every member's agent has the domain with exactly the members' addresses in its seats
    and reports it ``state`` (UP: every node READY and connected, as nvidia-imex-ctl -N
    says)."""
    want = sorted(bed.addresses[n] for n in members)
    for node in members:
        view = bed.domain_view(node, job.uid)
        if view is None or sorted(p for p in view["peers"] if p) != want \
                or view["state"] != state:
            return False
    return True


def daemon_pid(bed: DomainBed, job: Job, node: str) -> int:
    view = bed.domain_view(node, job.uid)
    assert view is not None and view["daemon"]["pid"], view
    return int(view["daemon"]["pid"])


def resolved_seats(bed: DomainBed, job: Job, node: str) -> list[str | None]:
    """The member's IMEX node list as its daemon resolves it (its names through its hosts)."""
    return imex_seats(bed.stacks[node], daemon_pid(bed, job, node))


def seat(bed: DomainBed, node: str) -> int:
    member = bed.member(node)
    assert member is not None and isinstance(member.get("seat"), int), member
    return int(member["seat"])


def held_channels(bed: DomainBed, node: str) -> list[str]:
    """The claims the node's agent holds an IMEX channel for."""
    return [c["uid"] for c in bed.stacks[node].agent_claims()
            if any(d.get("kind") == "imex-channel" for d in c.get("devices", []))]


def test_a_domain_job_forms_on_one_clique_and_survives_its_faults(bed: DomainBed) -> None:
    job = bed.submit("domain-job", DOMAIN)
    where = placed(bed, job)
    members = nodes_of(where)
    # One pod a node (each takes the node's four GPUs), all on the clique that has room.
    assert len(members) == DOMAIN, where
    assert {bed.cliques[n] for n in members} == {bed.cliques["nvl72-a-00"]}, where

    # The domain claim: one slot per pod, all of that clique, and a node selector naming it.
    _, claim = bed.server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/{job.namespace}/resourceclaims/"
               f"{job.claim}")
    allocation = claim["status"]["allocation"]
    assert len(allocation["devices"]["results"]) == DOMAIN
    assert {r["pool"].split("/")[0] for r in allocation["devices"]["results"]} <= {
        n for n, c in bed.cliques.items() if c == bed.cliques["nvl72-a-00"]}
    [term] = allocation["nodeSelector"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "gpu.nodeagent.dev/fabric-clique",
                                         "operator": "In",
                                         "values": [bed.cliques["nvl72-a-00"]]}], term

    answers = bed.prepare_all(job, where)
    for pod, answer in answers.items():
        node = where[pod]
        assert answer.get("ok"), f"{pod} on {node}: {answer}\n{bed.stacks[node].plugin.log()}"
        devices = answer["containers"]["worker"]
        injected = bed.stacks[node].kubelet.cdi_inject(  # type: ignore[union-attr]
            devices, [bed.stacks[node].cdi_dir])
        assert not injected.get("unresolved"), injected
        paths = [d["path"] for d in injected["device_nodes"]]
        assert CHANNEL in paths, dumps(injected)
    wait_for(lambda: domain_up(bed, job, members), "the domain UP on every member", 60)
    seats = resolved_seats(bed, job, members[0])
    assert sorted(a for a in seats if a) == sorted(bed.addresses[n] for n in members), seats
    for node in members:
        # Every daemon resolves the same names to the same members, each at its seat.
        assert resolved_seats(bed, job, node) == seats
        assert seats[seat(bed, node)] == bed.addresses[node]
        # Two writes of its own Node to join, whatever the domain's size.
        plugin = bed.stacks[node].plugin
        assert plugin.metric("gpu_agent_plugin_domain_node_writes_total", what="join") == 1
        assert plugin.metric("gpu_agent_plugin_domain_node_writes_total", what="state") == 1

    # One member's IMEX daemon killed: its agent starts it again, the domain comes back.
    victim = members[0]
    pid = bed.domain_view(victim, job.uid)["daemon"]["pid"]  # type: ignore[index]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (bed.domain_view(victim, job.uid) or {}).get("daemon", {}).get("pid")
             not in (None, pid), "the IMEX daemon restarted", 60)
    wait_for(lambda: domain_up(bed, job, members), "the domain UP after the IMEX kill", 60)

    # One member's agent killed and restarted: it adopts the daemon that kept running.
    survivor = members[1]
    pid = bed.domain_view(survivor, job.uid)["daemon"]["pid"]  # type: ignore[index]
    bed.stacks[survivor].restart_agent(signal.SIGKILL)
    assert bed.domain_view(survivor, job.uid)["daemon"]["pid"] == pid  # type: ignore[index]
    assert held_channels(bed, survivor) == [job.uid]
    wait_for(lambda: domain_up(bed, job, members), "the domain UP after the agent kill", 60)

    # One member's plugin killed and restarted: it follows the domain its Node announces.
    bed.stacks[members[2]].restart_plugin(signal.SIGKILL)
    bed.stacks[members[2]].plugin.wait_ready()

    # A member node lost (its stack gone, its Node NotReady and tainted as the node
    # lifecycle controller marks it): the others run IMEX with the two left.
    lost = members[2]
    lost_seat = seat(bed, lost)
    pids = {node: daemon_pid(bed, job, node) for node in members[:2]}
    bed.lose(lost)
    left = members[:2]
    wait_for(lambda: domain_up(bed, job, left, state="DEGRADED"),
             "the two left DEGRADED, the lost node's seat empty", 60)
    for node in left:
        assert resolved_seats(bed, job, node)[lost_seat] is None

    # The lost pod's replacement (its controller's new pod) lands on the clique's spare node
    # and takes the lost node's seat; the two healthy members let it in by a hosts change and
    # a reconnect, their daemons not restarted, and the domain is UP again.
    bed.add_pod(job, "domain-job-again")
    where.update(placed(bed, job))
    spare = where["domain-job-again"]
    assert spare not in members and bed.cliques[spare] == bed.cliques[lost], where
    answer = bed.prepare(job, "domain-job-again", spare, within_s=120)
    assert answer.get("ok"), f"{answer}\n{bed.stacks[spare].plugin.log()}"
    now = [*left, spare]
    wait_for(lambda: domain_up(bed, job, now), "the domain UP with the replacement", 60)
    assert seat(bed, spare) == lost_seat
    for node in left:
        assert daemon_pid(bed, job, node) == pids[node], f"{node}'s IMEX was restarted"
        assert resolved_seats(bed, job, node)[lost_seat] == bed.addresses[spare]
    assert resolved_seats(bed, job, spare) == resolved_seats(bed, job, left[0])

    # The job ends: every member leaves, stops IMEX and holds no channel.
    left = now
    still = {pod: node for pod, node in where.items() if node != lost}
    for pod, answer in bed.unprepare_all(job, still).items():
        assert answer.get("ok"), f"{pod}: {answer}"
    for node in left:
        assert bed.domain_view(node, job.uid) is None
        assert held_channels(bed, node) == []
        _, body = bed.server.request("GET", f"/api/v1/nodes/{node}")
        assert "gpu.nodeagent.dev/compute-domain" not in body["metadata"].get("labels", {})
        assert bed.member(node) is None
    bed.release(job)


def test_a_domain_forms_with_a_plugin_and_an_agent_killed_while_it_forms(
        bed: DomainBed) -> None:
    """Two members wait for the third; meanwhile one's plugin and the other's agent are
    killed and restarted. Kubelet's retries and the restarted plugin's recovery keep them
    members, and when the third joins the domain forms with exactly the three."""
    job = bed.submit("forming", DOMAIN, name="forming")
    where = placed(bed, job)
    first, second, last = sorted(where)
    waiting = {pod: bed.preparing(job, pod, where[pod]) for pod in (first, second)}
    wait_for(lambda: all((bed.member(where[p]) or {}).get("state") == "Joining"
                         for p in (first, second)), "two members joining", 60)
    bed.stacks[where[first]].restart_plugin(signal.SIGKILL)
    bed.stacks[where[second]].restart_agent(signal.SIGKILL)
    answers = {last: bed.prepare(job, last, where[last], within_s=120)}
    answers.update({pod: future.result() for pod, future in waiting.items()})
    for pod, answer in answers.items():
        assert answer.get("ok"), f"{pod}: {answer}\n{bed.stacks[where[pod]].plugin.log()}"
    members = nodes_of(where)
    wait_for(lambda: domain_up(bed, job, members), "the domain UP on every member", 60)
    for node in members:
        assert sorted(a for a in resolved_seats(bed, job, node) if a) == sorted(
            bed.addresses[n] for n in members)
    for pod, answer in bed.unprepare_all(job, where).items():
        assert answer.get("ok"), f"{pod}: {answer}"
    for node in members:
        assert bed.domain_view(node, job.uid) is None and held_channels(bed, node) == []
    bed.release(job)


def test_a_job_larger_than_any_clique_stays_pending_saying_why(bed: DomainBed) -> None:
    """Five nodes in one clique: the first has four, the second two. The scheduler cannot
    allocate the domain claim on any node, so every pod stays Pending with its reason."""
    job = bed.submit("too-big", SIZE.first + 1)
    for pod in job.pods:
        message = wait_for(lambda pod=pod: unschedulable(bed.server, job.namespace, pod),
                           f"{pod} unschedulable", 60)
        assert "cannot allocate all claims" in message, message
    assert bed.bound(job) == {}
    # That is all the scheduler says; the plugin holding the explainer Lease says why, on the
    # claim, naming the largest clique.
    event = wait_for(lambda: bed.unfit_event(job), "the claim's ComputeDomainUnfit Event", 60)
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == job.uid, event
    assert f"{SIZE.first + 1} nodes in one NVLink clique" in event["message"], event
    assert f"the largest clique, {bed.cliques['nvl72-a-00']}, has {SIZE.first} nodes" \
        in event["message"], event
    status, claim = bed.server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/{job.namespace}/resourceclaims/"
               f"{job.claim}")
    assert status == 200 and not claim.get("status", {}).get("allocation"), claim


SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def slot_of(bed: DomainBed, node: str) -> Json | None:
    status, body = bed.server.request("GET", f"{SLICES}/{node}-compute-domain")
    return dict(body) if status == 200 else None


def clique_label(bed: DomainBed, node: str) -> str | None:
    _, body = bed.server.request("GET", f"/api/v1/nodes/{node}")
    return body["metadata"].get("labels", {}).get("gpu.nodeagent.dev/fabric-clique")


def offered(bed: DomainBed, node: str) -> bool:
    """The node's slot is on the server, selected by its clique's label, which it carries."""
    slot = slot_of(bed, node)
    return (slot is not None and clique_label(bed, node) == bed.cliques[node]
            and slot["spec"]["nodeSelector"]["nodeSelectorTerms"][0]["matchExpressions"][0][
                "values"] == [bed.cliques[node]])


def test_every_node_offers_one_slot_apart_from_its_gpus(bed: DomainBed) -> None:
    """Each node's slot is a slice of its own pool, selected by its clique's label; the
    node's GPUs stay in the node's pool, published by node name, without the slot."""
    for node in bed.stacks:
        wait_for(lambda node=node: offered(bed, node), f"{node}'s slot", 30)
        status, body = bed.server.request("GET", f"{SLICES}?fieldSelector=spec.nodeName={node}")
        assert status == 200, body
        assert all(s["spec"]["pool"]["name"] == node for s in body["items"])
        assert sorted(d["name"] for s in body["items"] for d in s["spec"]["devices"]) == [
            f"gpu-{i}" for i in range(4)]


def test_a_fabric_fault_withdraws_the_slot_and_label_until_it_is_completed(
        bed: DomainBed) -> None:
    """A slot deleted by someone else is recreated. One GPU's fabric registration in
    progress (POST /v1/sim/fabric): the plugin deletes the node's slot, then its label;
    completed again, both are back."""
    node = "nvl72-b-00"
    wait_for(lambda: offered(bed, node), f"{node}'s slot", 30)
    before = slot_of(bed, node)
    assert before is not None
    status, _ = bed.server.request("DELETE", f"{SLICES}/{node}-compute-domain")
    assert status == 200
    again = wait_for(lambda: offered(bed, node) and slot_of(bed, node), "the slot recreated",
                     30)
    assert again["metadata"]["uid"] != before["metadata"]["uid"]
    agent = bed.stacks[node].agent
    reply = agent.request("POST", "/v1/sim/fabric", {"gpu": "1", "condition": "in-progress"})
    assert reply.status == 204, reply.body
    try:
        wait_for(lambda: slot_of(bed, node) is None and clique_label(bed, node) is None,
                 "the slot and the label withdrawn", 60)
    finally:
        reply = agent.request("POST", "/v1/sim/fabric", {"gpu": "1", "condition": "completed"})
        assert reply.status == 204, reply.body
    wait_for(lambda: offered(bed, node), "the slot back", 60)
