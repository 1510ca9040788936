"""Scheduling a compute domain onto one NVLink clique (docs/compute-domains.md, "Asking for a
domain"), with the real kube-scheduler (1.37): five GB200 trays, three in clique A and two in
clique B. Tray a1 is a real agent (``--simulate gb200-nvl72``) and ``gpu-agent
kubelet-plugin``, which labels its Node and publishes its slot; the other four Nodes get the
label and the slot written as the plugin writes them (five full stacks are too heavy for the
test machine's two cores). A shared claim for three slots is allocated on clique A, with an
allocation node selector naming it, and every pod sharing it is bound to a node of A; a claim
for four (more than any clique has) is not allocated and its pod stays Pending, saying why.
A fabric fault on one of a1's GPUs withdraws its slot and label; completed, both are back."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agent.kubeplugin.domain_slots import desired_body
from tests.k8s.harness import NEWEST, ApiServer, KubeScheduler, schedulable_node
from tests.k8s.objects import DRIVER
from tests.k8s.stack import DEVICE_CLASSES, Stack, apply_shipped, stack_factory
from tests.waiting import wait_for

pytestmark = pytest.mark.xdist_group(f"kube-apiserver-{NEWEST}")

RESOURCE = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE}/resourceslices"
NAMESPACE = "domains"
CLASS = f"compute-domain.{DRIVER}"
LABEL = f"{DRIVER}/fabric-clique"
CLUSTER_A = "6a1f4c2e-0000-4000-8000-00000000000a"
CLUSTER_B = "6a1f4c2e-0000-4000-8000-00000000000b"
A, B = f"{CLUSTER_A}.1", f"{CLUSTER_B}.2"
REAL = "tray-a1"
#: Each tray's clique (tray a1's is the real agent's: --sim-cluster-uuid, --sim-clique-id).
TRAYS = {REAL: A, "tray-a2": A, "tray-a3": A, "tray-b1": B, "tray-b2": B}
Json = dict[str, Any]


@dataclass
class Domains:
    server: ApiServer
    scheduler: KubeScheduler
    real: Stack


def slot_of(server: ApiServer, node: str) -> Json | None:
    status, body = server.request("GET", f"{SLICES}/{node}-compute-domain")
    assert status in (200, 404), body
    return dict(body) if status == 200 else None


def label_of(server: ApiServer, node: str) -> str | None:
    status, body = server.request("GET", f"/api/v1/nodes/{node}")
    assert status == 200, body
    value = (body["metadata"].get("labels") or {}).get(LABEL)
    return None if value is None else str(value)


def published(server: ApiServer, node: str, clique: str) -> Json | None:
    """The node's slot when it is published as the plugin publishes it for ``clique``: the
    Node labelled, the slice of pool ``<node>/compute-domain`` owned by the Node, selecting
    the label, its one device carrying ``fabricClique``."""
    slot = slot_of(server, node)
    if slot is None or label_of(server, node) != clique:
        return None
    spec = slot["spec"]
    uid = server.request("GET", f"/api/v1/nodes/{node}")[1]["metadata"]["uid"]
    assert slot["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}]
    assert "nodeName" not in spec and spec["pool"]["name"] == f"{node}/compute-domain"
    assert spec["nodeSelector"] == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": LABEL, "operator": "In", "values": [clique]}]}]}
    assert [(d["name"], d["attributes"]) for d in spec["devices"]] == [
        ("slot", {"type": {"string": "compute-domain-slot"},
                  "fabricClique": {"string": clique}})]
    return slot


def withdrawn(server: ApiServer, node: str) -> bool:
    return slot_of(server, node) is None and label_of(server, node) is None


def write_as_the_plugin(server: ApiServer, template: Json, node: str, clique: str) -> None:
    """Label ``node`` and write its slot as the plugin does (domain_slots.desired_body), from
    a slot the real agent rendered with its node and clique replaced."""
    server.kubectl("label", "node", node, f"{LABEL}={clique}", "--overwrite")
    slot = copy.deepcopy(template)
    slot["metadata"] = {"name": f"{node}-compute-domain"}
    spec = slot["spec"]
    spec["pool"] = {"name": f"{node}/compute-domain", "generation": 0, "resourceSliceCount": 1}
    spec["nodeSelector"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] = [clique]
    spec["devices"][0]["attributes"]["fabricClique"] = {"string": clique}
    uid = server.request("GET", f"/api/v1/nodes/{node}")[1]["metadata"]["uid"]
    status, body = server.request("POST", SLICES, desired_body(slot, node_name=node,
                                                               node_uid=uid, existing=None))
    assert status == 201, body


@pytest.fixture(scope="module")
def domains(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Domains]:
    root = tmp_path_factory.mktemp("domains")
    server = ApiServer.start(NEWEST, root / "apiserver")
    stacks = stack_factory()
    start = next(stacks)
    try:
        apply_shipped(server, DEVICE_CLASSES)
        for node in TRAYS:
            schedulable_node(server, node)
        real = start(server, "gb200-nvl72", node=REAL, kubelet=False, agent_extra=[
            "--sim-cluster-uuid", CLUSTER_A, "--sim-clique-id", "1"])
        try:
            slot = wait_for(lambda: published(server, REAL, A), "tray a1's slot", 60,
                            every_s=0.1)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{real.plugin.log()[-4000:]}") from None
        template = {"apiVersion": slot["apiVersion"], "kind": slot["kind"],
                    "metadata": {"name": slot["metadata"]["name"]}, "spec": slot["spec"]}
        for node, clique in TRAYS.items():
            if node != REAL:
                write_as_the_plugin(server, template, node, clique)
        status, namespace = server.request("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        assert status in (201, 409), namespace
        scheduler = KubeScheduler(server, root=root / "scheduler")
        try:
            yield Domains(server, scheduler, real)
        finally:
            scheduler.close()
    finally:
        next(stacks, None)
        server.stop()


def domain_claim(server: ApiServer, name: str, nodes: int) -> None:
    """One claim for ``nodes`` slots on one clique, as the example asks."""
    status, body = server.request("POST", f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": "nodes", "exactly": {
                "deviceClassName": CLASS, "allocationMode": "ExactCount", "count": nodes}}],
            "constraints": [{"requests": ["nodes"],
                             "matchAttribute": f"{DRIVER}/fabricClique"}]}}})
    assert status == 201, body


def sharing_pod(server: ApiServer, name: str, claim: str) -> None:
    status, body = server.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never",
                 "resourceClaims": [{"name": "domain", "resourceClaimName": claim}],
                 "containers": [{"name": "trainer", "image": "registry.invalid/none",
                                 "resources": {"claims": [{"name": "domain"}]}}]}})
    assert status == 201, body


def pod(server: ApiServer, name: str) -> Json:
    status, body = server.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    assert status == 200, body
    return dict(body)


def claim(server: ApiServer, name: str) -> Json:
    status, body = server.request("GET",
                                  f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{name}")
    assert status == 200, body
    return dict(body)


def all_published(domains: Domains) -> None:
    """Every tray's slot is there (a test that withdrew a1's put it back)."""
    for node, clique in TRAYS.items():
        wait_for(lambda n=node, c=clique: published(domains.server, n, c),  # type: ignore[misc]
                 f"{node}'s slot", 60, every_s=0.1)


def test_a_domain_lands_on_the_one_clique_it_fits(domains: Domains) -> None:
    """Three pods sharing a claim for three slots: the claim gets the three slots of clique
    A (one per node of A), its allocation's node selector names A, and every pod is bound to
    a node of A; clique B's two nodes have no slot to give."""
    all_published(domains)
    server = domains.server
    name = f"three-{uuid.uuid4().hex[:6]}"
    domain_claim(server, name, 3)
    pods = [f"{name}-{i}" for i in range(3)]
    for each in pods:
        sharing_pod(server, each, name)
    bound = {each: wait_for(lambda p=each: pod(server, p)["spec"].get("nodeName"),  # type: ignore[misc]
                            f"pod {each} bound", 60, every_s=0.1) for each in pods}
    assert {TRAYS[node] for node in bound.values()} == {A}, bound
    allocation = claim(server, name)["status"]["allocation"]
    results = allocation["devices"]["results"]
    assert sorted((r["driver"], r["pool"], r["device"]) for r in results) == [
        (DRIVER, f"{node}/compute-domain", "slot") for node in ("tray-a1", "tray-a2", "tray-a3")]
    assert allocation["nodeSelector"] == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": LABEL, "operator": "In", "values": [A]}]}]}
    reserved = {r["name"] for r in claim(server, name)["status"]["reservedFor"]}
    assert reserved == set(pods)


def test_a_domain_bigger_than_any_clique_stays_pending(domains: Domains) -> None:
    """A claim for four slots (clique A has three nodes, B two): not allocated, its pod
    unschedulable, the scheduler saying that the claim cannot be allocated."""
    all_published(domains)
    server = domains.server
    name = f"four-{uuid.uuid4().hex[:6]}"
    domain_claim(server, name, 4)
    sharing_pod(server, name, name)

    def unschedulable() -> Json | None:
        conditions = pod(server, name)["status"].get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodScheduled"
                     and c["status"] == "False"), None)

    condition = wait_for(unschedulable, "the pod reported unschedulable", 60, every_s=0.1)
    assert condition["reason"] == "Unschedulable"
    assert "cannot allocate all claims" in condition["message"], condition
    assert pod(server, name)["spec"].get("nodeName") is None
    assert "allocation" not in (claim(server, name).get("status") or {})


def test_a_fabric_fault_withdraws_the_slot_and_label_until_it_is_completed(
        domains: Domains) -> None:
    """GPU 1 of tray a1 in-progress (POST /v1/sim/fabric): the plugin deletes a1's slot,
    then its label; completed again, both are back as before. A slot deleted by someone else
    is recreated."""
    all_published(domains)
    server, agent = domains.server, domains.real.agent
    before = slot_of(server, REAL)
    assert before is not None
    status, _ = server.request("DELETE", f"{SLICES}/{REAL}-compute-domain")
    assert status == 200
    again = wait_for(lambda: published(server, REAL, A), "a1's slot recreated", 30,
                     every_s=0.1)
    assert again["metadata"]["uid"] != before["metadata"]["uid"]

    reply = agent.request("POST", "/v1/sim/fabric", {"gpu": "1", "condition": "in-progress"})
    assert reply.status == 204, reply.body
    try:
        wait_for(lambda: withdrawn(server, REAL), "a1's slot and label withdrawn", 60,
                 every_s=0.1)
    finally:
        reply = agent.request("POST", "/v1/sim/fabric", {"gpu": "1", "condition": "completed"})
        assert reply.status == 204, reply.body
    wait_for(lambda: published(server, REAL, A), "a1's slot back", 60, every_s=0.1)


def test_the_gpu_pool_keeps_its_own_slices(domains: Domains) -> None:
    """The publisher of a1's GPUs publishes them by node name, without the slot; the slot's
    slice is the only one of the compute-domain pool."""
    all_published(domains)
    server = domains.server
    status, body = server.request("GET", f"{SLICES}?fieldSelector=spec.nodeName={REAL}")
    assert status == 200, body
    gpus = [d["name"] for s in body["items"] for d in s["spec"]["devices"]]
    assert sorted(gpus) == [f"gpu-{i}" for i in range(4)]
    assert all(s["spec"]["pool"]["name"] == REAL for s in body["items"])

