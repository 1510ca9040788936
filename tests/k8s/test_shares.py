"""Memory shares of one GPU (``--gpu-shares``, DRA consumable capacity) with real Kubernetes:
the scheduler's allocator counts shares of an L40S from the slices a real agent publishes;
kubelet's DRA manager prepares them through ``gpu-agent kubelet-plugin`` and the agent and
gets each share's ID back; a 1.34 API server without ``DRAConsumableCapacity`` drops the
fields and the plugin publishes the GPUs whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.podresources.proto import podresources_v1_pb2, podresources_v1_pb2_grpc
from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.harness import SLICE_RULES, VERSIONS, allocate, allocate_in_cluster
from tests.k8s.objects import (
    DRIVER,
    attr,
    claim,
    classes,
    devices_of,
    pod,
    request,
    with_allocation,
)
from tests.k8s.published import gpu_uuid, slices_of
from tests.k8s.stack import DEVICE_CLASSES, Stack, StartStack, apply_shipped, wait_for
from tests.k8s.workload import allocate as allocate_pod
from tests.k8s.workload import claim_uid, unprepare

Json = dict[str, Any]
NODE = "share-node-1"
L40S_SHAREABLE_GIB = 44  # 46,068 MiB rounded down to whole GiB


def share_request(memory: str | None, uuid: str, name: str = "gpu") -> Json:
    """One GPU of this UUID, taking ``memory`` of it (None: the policy's default, all)."""
    body = request(name, selectors=(f'{attr("uuid")} == "{uuid}"',))
    if memory is not None:
        body["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return body


class Shares:
    """An agent's slices and the claims the allocator placed on them so far."""

    def __init__(self, version: str, slices: list[Json]) -> None:
        self.version = version
        self.slices = slices
        self.allocated: list[Json] = []

    def place(self, memory: str | None, uuid: str) -> Json | None:
        """The allocation result of one claim for ``memory`` of GPU ``uuid``; None when the
        allocator refuses it. Placed claims stay allocated for the next ones."""
        wanted = claim(f"c{len(self.allocated)}", share_request(memory, uuid))
        answer = allocate(self.version, node=NODE, slices=self.slices, classes=classes(),
                          claims=[wanted], allocated=self.allocated,
                          feature_gates=DRA_GATES[self.version])
        if not answer.allocated:
            return None
        allocation = answer.results[0]["allocation"]
        self.allocated.append(with_allocation(wanted, allocation))
        [result] = allocation["devices"]["results"]
        return dict(result)


@pytest.mark.parametrize("version", VERSIONS)
def test_four_10gi_shares_fit_one_l40s_and_a_fifth_does_not(version: str,
                                                            agent_node: StartAgent) -> None:
    """On an L40S published shareable (44 GiB), four claims of memory 10Gi all land on that
    GPU, each a share of its own (a distinct shareID, 10Gi consumed); a fifth 10Gi is
    refused, 4Gi still fits exactly, and then neither 1Gi nor the whole GPU does. Another
    GPU takes at most its 44Gi in one claim on 1.37; 1.34.4's alpha allocator counts the
    memory already shared out of GPU 0 against GPU 1 too (observed: after 10Gi of GPU 0 it
    gives GPU 1 at most 34Gi), which errs on the safe side: never an overcommit."""
    agent = agent_node("l40s", node_name=NODE, extra=("--gpu-shares",))
    slices = slices_of(agent, SLICE_RULES[version])
    memory = devices_of(slices)["gpu-0"]["capacity"]["memory"]
    assert memory["value"] == f"{L40S_SHAREABLE_GIB}Gi", memory
    gpu0, gpu1 = gpu_uuid(agent, 0), gpu_uuid(agent, 1)
    node = Shares(version, slices)

    shares = [node.place("10Gi", gpu0) for _ in range(4)]
    assert all(s is not None and s["device"] == "gpu-0" for s in shares), shares
    assert len({s["shareID"] for s in shares if s}) == 4
    assert all(s and s["consumedCapacity"]["memory"] == "10Gi" for s in shares), shares
    assert node.place("10Gi", gpu0) is None
    last = node.place("4Gi", gpu0)
    assert last is not None and last["device"] == "gpu-0"
    assert node.place("1Gi", gpu0) is None
    assert node.place(None, gpu0) is None
    assert node.place(f"{L40S_SHAREABLE_GIB + 1}Gi", gpu1) is None
    whole = node.place(f"{L40S_SHAREABLE_GIB}Gi", gpu1)
    if version == "1.34":
        assert whole is None
        return
    assert whole is not None and whole["device"] == "gpu-1"


def share_claim(name: str, memory: str, uuid: str) -> Json:
    body = claim(name, share_request(memory, uuid))
    del body["metadata"]["uid"]  # the server assigns it
    return body


def share_ids(socket: Path) -> dict[str, list[str | None]]:
    """Pod name -> the share IDs of its devices, from kubelet's PodResources v1 API."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = podresources_v1_pb2_grpc.PodResourcesListerStub(channel)
        answer = stub.List(podresources_v1_pb2.ListPodResourcesRequest(), timeout=10)
    found: dict[str, list[str | None]] = {}
    for item in answer.pod_resources:
        for container in item.containers:
            for dynamic in container.dynamic_resources:
                found.setdefault(item.name, []).extend(
                    r.share_id if r.HasField("share_id") else None
                    for r in dynamic.claim_resources)
    return found


def start_pods(running: Stack, memory: str, uuid: str, count: int, *,
               prefix: str = "share") -> list[str]:
    """``count`` pods on the stack's node, each with a claim of its own for ``memory``,
    named ``<prefix>-<i>`` (the session's server is shared: a test of its own, a prefix)."""
    apply_shipped(running.server, DEVICE_CLASSES)
    names = [f"{prefix}-{i}" for i in range(count)]
    running.server.apply([share_claim(n, memory, uuid) for n in names]
                         + [pod(n, {"c": n}, node_name=running.node) for n in names])
    return names


@pytest.mark.parametrize("version", VERSIONS)
def test_kubelet_prepares_four_shares_and_gets_back_each_share_id(
        version: str, kube_apiservers: StartApiServer, stack: StartStack) -> None:
    """Four pods each with a claim of memory 10Gi of one L40S are allocated on it from the
    published slices, and kubelet's DRA manager prepares each through the plugin and the
    agent: the agent holds each as a 10 GiB share of that GPU with its allocation's shareID,
    and a fifth claim is not allocated. 1.37's kubelet gets each shareID back (PodResources
    shows it); 1.34's protocol has no share_id, so its kubelet has none (the plugin's field
    is ignored, nothing fails). After unprepare the agent holds nothing."""
    gates = DRA_GATES[version]
    server = kube_apiservers(version)
    running = stack(server, "l40s", node=f"share-e2e-{version}".replace(".", "-"),
                    agent_extra=["--gpu-shares"], kubelet_gates=gates)
    assert running.kubelet is not None
    uuid = gpu_uuid(running.agent, 0)
    names = start_pods(running, "10Gi", uuid, 5)
    allocated: dict[str, Json] = {}
    for name in names[:4]:
        answer = allocate_pod(running, name, feature_gates=gates)
        assert answer.allocated, answer.reason
        [result] = answer.results[0]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-0", result
        allocated[name] = result
    assert not allocate_pod(running, names[4], feature_gates=gates).allocated

    for name in names[:4]:
        prepared = running.kubelet.prepare(f"default/{name}")
        assert prepared["ok"], f"{prepared}\n{running.plugin.log()}"
    assert share_ids(running.kubelet.pod_resources_socket) == {
        name: [allocated[name]["shareID"] if version != "1.34" else None]
        for name in names[:4]}
    held = {c["uid"]: c["devices"] for c in running.agent_claims()}
    assert set(held) == {claim_uid(running, n) for n in names[:4]}
    for name in names[:4]:
        [device] = held[claim_uid(running, name)]
        assert device["device_name"] == "gpu-0"
        assert device["share"] == {"memory_mib": 10240,
                                   "share_id": allocated[name]["shareID"]}, device

    for name in names[:4]:
        unprepare(running, name)
    assert running.agent_claims() == []


def test_a_134_server_without_the_gate_gets_whole_gpus(kube_apiservers: StartApiServer,
                                                       stack: StartStack) -> None:
    """A 1.34 API server with DRAConsumableCapacity off drops allowMultipleAllocations and the
    request policies: the plugin publishes every GPU whole, says so in /readyz and its
    metric, and the scheduler gives a claim the whole GPU (its memory request dropped too)
    and a second claim for that GPU nothing."""
    server = kube_apiservers("1.34", feature_gates="")
    running = stack(server, "l40s", node="share-nogate", agent_extra=["--gpu-shares"],
                    kubelet=False)

    def withdrawn() -> bool:
        return running.plugin.metric("gpu_agent_plugin_slice_features_withdrawn",
                                     feature="shares") == 1

    wait_for("shares withdrawn", withdrawn, 30, log=running.plugin.log)

    def whole(slices: list[dict[str, Any]]) -> bool:
        gpus = [d for s in slices for d in s["spec"]["devices"]]
        return len(gpus) == 4 and not any("shareable" in d["attributes"] for d in gpus)

    # Nor the attribute class share.nodeagent.dev selects: a share asked of it stays pending.
    # (The metric moves when the server's answer shows the drop; the slices written without
    # the shares follow it.)
    gpus = [d for s in running.wait_slices(until=whole) for d in s["spec"]["devices"]]
    assert not any(d.get("allowMultipleAllocations") for d in gpus), gpus
    assert not any("requestPolicy" in d["capacity"]["memory"] for d in gpus), gpus
    status, body = running.plugin.readyz()
    assert status == 503 and "published whole, not shareable" in str(body), body

    uuid = gpu_uuid(running.agent, 0)
    names = start_pods(running, "10Gi", uuid, 2)
    status, stored = server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{names[0]}")
    assert status == 200 and "capacity" not in stored["spec"]["devices"]["requests"][0][
        "exactly"], stored  # dropped with the gate off, as the slices' fields are
    first = allocate_pod(running, names[0])
    assert first.allocated, first.reason
    [result] = first.results[0]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0" and "shareID" not in result, result
    assert not allocate_pod(running, names[1]).allocated


def reserve(running: Stack, claim_name: str, pod_name: str) -> None:
    """Add pod ``pod_name`` to the claim's reservedFor, as the scheduler does for a second
    pod using an allocated claim (a merge patch of the status: a PUT of the object read
    back would rewrite the opaque parameters' bytes, which the server refuses)."""
    base = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{claim_name}"
    status, stored = running.server.request("GET", base)
    assert status == 200 and stored["status"].get("allocation"), stored
    status, found = running.server.request("GET", f"/api/v1/namespaces/default/pods/{pod_name}")
    assert status == 200, found
    reserved = [*stored["status"].get("reservedFor", []),
                {"resource": "pods", "name": pod_name, "uid": found["metadata"]["uid"]}]
    running.server.kubectl("patch", "resourceclaim", claim_name, "--subresource=status",
                           "--type=merge", "-p", json.dumps({"status": {"reservedFor": reserved}}))


MPS_CONFIG = {"apiVersion": "resource.nodeagent.dev/v1beta1", "kind": "GpuConfig",
              "sharing": {"strategy": "MPS", "mpsConfig": {
                  "defaultActiveThreadPercentage": 50,
                  "defaultPinnedDeviceMemoryLimit": "10Gi"}}}


def test_two_pods_share_one_mps_claim_with_one_daemon(kube_apiservers: StartApiServer,
                                                     stack: StartStack) -> None:
    """On 1.37, a claim with an opaque GpuConfig (MPS, 50 %, 10Gi) used by two pods is
    prepared once: both pods get the same CDI devices, the agent runs one MPS daemon for the
    claim with those limits, and the CDI reference library gives each container the
    daemon's pipe directory (CUDA_MPS_PIPE_DIRECTORY and its mount); after both pods go the
    claim and its daemon are gone."""
    server = kube_apiservers("1.37")
    running = stack(server, "l40s", node="mps-e2e")
    assert running.kubelet is not None
    apply_shipped(running.server, DEVICE_CLASSES)
    shared = claim("mps", request())
    del shared["metadata"]["uid"]
    shared["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": MPS_CONFIG}}]
    running.server.apply([shared, pod("mps-a", {"c": "mps"}, node_name=running.node),
                          pod("mps-b", {"c": "mps"}, node_name=running.node)])
    answer = allocate_in_cluster(running.server, node=running.node, claims=["default/mps"],
                                 pod="default/mps-a")
    assert answer.allocated, answer.reason
    reserve(running, "mps", "mps-b")

    ids = {}
    for name in ("mps-a", "mps-b"):
        prepared = running.kubelet.prepare(f"default/{name}")
        assert prepared["ok"], f"{prepared}\n{running.plugin.log()}"
        ids[name] = prepared["containers"]["main"]
    assert ids["mps-a"] == ids["mps-b"]
    [record] = running.agent_claims()
    assert record["mps"] is not None and record["mps"]["state"] == "running", record
    [device] = record["devices"]
    assert device["sharing"]["strategy"] == "MPS", device
    injected = running.kubelet.cdi_inject(ids["mps-a"], [running.cdi_dir])
    assert injected["ok"] and injected["unresolved"] == [], injected
    [pipe] = [e.split("=", 1)[1] for e in injected["env"]
              if e.startswith("CUDA_MPS_PIPE_DIRECTORY=")]
    assert any(m["destination"] == pipe and m["source"] == record["mps"]["pipe_directory"]
               for m in injected["mounts"]), injected["mounts"]

    unprepare(running, "mps-a")
    assert len(running.agent_claims()) == 1  # kubelet keeps it while mps-b uses it
    unprepare(running, "mps-b")
    assert running.agent_claims() == []
