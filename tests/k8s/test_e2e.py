"""End to end on the newest Kubernetes: a Pod and its ResourceClaim in a real API server,
allocated by the scheduler's allocator from the slices the real plugin published, prepared
through kubelet's DRA manager -> ``gpu-agent kubelet-plugin`` -> the agent, the CDI IDs
resolved and injected by the CDI reference library, then unprepared."""

from __future__ import annotations

import json
from typing import Any

from tests.k8s.harness import ApiServer, allocate_in_cluster
from tests.k8s.objects import claim, pod, request
from tests.k8s.stack import DEVICE_CLASSES, Stack, StartStack, apply_shipped

Json = dict[str, Any]
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
GPU = "gpu.nodeagent.dev"


def create_pod_with_claim(server: ApiServer, name: str, node: str, *requests: Json) -> None:
    """A ResourceClaim ``name`` and a Pod ``name`` on ``node`` using it (uid from the server)."""
    apply_shipped(server, DEVICE_CLASSES)
    wanted = claim(name, *requests)
    wanted["metadata"].pop("uid")
    server.apply([wanted, pod(name, {"c": name}, node_name=node)])


def prepare_and_inject(stack: Stack, name: str) -> tuple[list[str], Json]:
    """Prepare pod ``name`` through kubelet; its CDI IDs and the injection of them."""
    assert stack.kubelet is not None
    prepared = stack.kubelet.prepare(f"default/{name}")
    assert prepared["ok"], f"{prepared}\n{stack.plugin.log()}"
    ids = prepared["containers"]["main"]
    injected = stack.kubelet.cdi_inject(ids, [stack.cdi_dir])
    assert injected["ok"] and injected["unresolved"] == [], injected
    assert injected["spec_errors"] == {}, injected
    return ids, injected


def test_full_gpu_claim_runs_through_the_whole_stack(kube_apiserver: ApiServer,
                                                     stack: StartStack) -> None:
    """A whole-GPU claim allocated from the plugin's slices is prepared by the agent through
    kubelet and the plugin, injects that GPU's device node, and is gone from the agent after
    unprepare."""
    node = "e2e-full"
    running = stack(kube_apiserver, "dgx-h100", node=node)
    create_pod_with_claim(kube_apiserver, "full", node, request(device_class_name=GPU))
    answer = allocate_in_cluster(kube_apiserver, node=node, claims=["default/full"],
                                 pod="default/full")
    assert answer.allocated, answer.reason
    [device] = answer.devices()

    ids, injected = prepare_and_inject(running, "full")
    paths = {n["path"] for n in injected["device_nodes"]}
    assert f"/dev/nvidia{device.split('-')[1]}" in paths, paths
    status, stored = kube_apiserver.request("GET", f"{CLAIMS}/full")
    assert status == 200
    [held] = running.agent_claims()
    assert held["uid"] == stored["metadata"]["uid"], json.dumps(held)
    assert ids

    unprepared = running.kubelet.unprepare("default/full") if running.kubelet else {}
    assert unprepared["ok"], unprepared
    assert running.agent_claims() == []
