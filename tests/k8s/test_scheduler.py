"""The real kube-scheduler (1.37) on a mixed cluster of simulated nodes, each a real agent
publishing through a real ``gpu-agent kubelet-plugin``, with kubelet's DRA manager: the
shipped DeviceClasses and every example of daemonset/examples/ placed onto the node kind it is
meant for (a share never on a GPU that is not shareable), and an unchanged legacy pod asking
for ``resources.limits`` of an extended resource placed through DRA (KEP-5004) and prepared
by the plugin. One API server, one scheduler and the four nodes serve the whole module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.k8s import scheduling
from tests.k8s.harness import NEWEST, ApiServer, KubeScheduler, schedulable_node
from tests.k8s.objects import DRIVER
from tests.k8s.published import set_mig
from tests.k8s.scheduling import create, ensure_namespace
from tests.k8s.stack import DEVICE_CLASSES, ROOT, Stack, apply_shipped, stack_factory

# The shared 1.37 servers' worker (conftest.py's groups): this module's own server and
# scheduler start once there, not once per pytest worker that gets one of its tests.
pytestmark = pytest.mark.xdist_group(f"kube-apiserver-{NEWEST}")

EXAMPLES = ROOT / "daemonset" / "examples"
Json = dict[str, Any]


@dataclass(frozen=True)
class NodeKind:
    name: str
    preset: str
    agent_extra: tuple[str, ...] = ()
    #: Static MIG geometry set before the examples: (GPU index, profiles).
    geometry: tuple[tuple[int, tuple[str, ...]], ...] = ()


WHOLE = NodeKind("whole-h100", "dgx-h100", geometry=((7, ("1g.10gb",) * 7),))
BRIDGED = NodeKind("bridged-a100", "a100-pcie-bridged")
DYNAMIC = NodeKind("dynamic-h100", "dgx-h100", ("--dynamic-mig",))
SHARES = NodeKind("shares-l40s", "l40s", ("--gpu-shares",))
NODES = (WHOLE, BRIDGED, DYNAMIC, SHARES)


@dataclass
class Cluster:
    server: ApiServer
    scheduler: KubeScheduler
    stacks: dict[str, Stack]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 1.37 API server of this module, the four node kinds (agent, plugin, kubelet harness
    each; Nodes as a kubelet registers them), the shipped DeviceClasses and kube-scheduler."""
    root = tmp_path_factory.mktemp("scheduler")
    server = ApiServer.start(NEWEST, root / "apiserver")
    stacks = stack_factory()
    start = next(stacks)
    try:
        apply_shipped(server, DEVICE_CLASSES)
        running: dict[str, Stack] = {}
        for kind in NODES:
            schedulable_node(server, kind.name)
            running[kind.name] = start(server, kind.preset, node=kind.name,
                                       agent_extra=kind.agent_extra)
            for gpu, profiles in kind.geometry:
                set_mig(running[kind.name].agent, gpu, list(profiles))
        for stack in running.values():
            stack.wait_current()
        scheduler = KubeScheduler(server, root=root / "scheduler")
        try:
            yield Cluster(server, scheduler, running)
        finally:
            scheduler.close()
    finally:
        next(stacks, None)  # stack_factory's teardown: every agent, plugin and kubelet
        server.stop()


def apply_example(server: ApiServer, example: str, namespace: str) -> list[str]:
    """The example's objects in ``namespace`` (:func:`scheduling.create_workload`); its pods."""
    return scheduling.create_workload(server, scheduling.documents(EXAMPLES / example),
                                      namespace)


def bound_node(cluster: Cluster, namespace: str, pod: str) -> str:
    return scheduling.bound_node(cluster.server, cluster.scheduler, namespace, pod)


def claims_of(cluster: Cluster, namespace: str, pod: str) -> list[Json]:
    return scheduling.claims_of(cluster.server, namespace, pod)


#: Each example and the node kinds it is meant for. A whole H100 and four NVLinked GPUs are
#: also what a dynamic-MIG H100 node offers (its GPUs are published whole beside their
#: placements), so either H100 node is right for them; nothing else is.
PLACEMENTS = [
    ("full-gpu.yaml", {WHOLE.name, DYNAMIC.name}),
    ("mig-1g10gb.yaml", {WHOLE.name}),
    ("dynamic-mig.yaml", {DYNAMIC.name}),
    ("tensor-parallel-4gpu.yaml", {WHOLE.name, DYNAMIC.name}),
    ("memory-share.yaml", {SHARES.name}),
    ("mps-shared.yaml", {SHARES.name}),
    ("time-slicing.yaml", {SHARES.name}),
]


#: Examples placed elsewhere, and why.
ELSEWHERE = {
    # Pods of a Job across nodes of one NVLink clique (GB200 trays), not one node kind.
    "compute-domain.yaml": "tests/k8s/test_compute_domains.py",
}


def test_every_example_is_in_the_table() -> None:
    assert {p.name for p in EXAMPLES.glob("*.yaml")} == {e for e, _ in PLACEMENTS} | set(
        ELSEWHERE)


@pytest.mark.parametrize(("example", "meant_for"), PLACEMENTS,
                         ids=[e.removesuffix(".yaml") for e, _ in PLACEMENTS])
def test_example_lands_on_the_node_kind_it_is_meant_for(example: str, meant_for: set[str],
                                                        cluster: Cluster) -> None:
    """kube-scheduler binds each of the example's pods to a node of the intended kind, and
    allocates its claims from that node's pool only: a share (memory-share, and the sharing
    configs of mps-shared and time-slicing) on the node that publishes shareable GPUs, never
    as a whole GPU of another node."""
    namespace = f"example-{example.removesuffix('.yaml')}"
    pods = apply_example(cluster.server, example, namespace)
    assert pods
    for pod in pods:
        node = bound_node(cluster, namespace, pod)
        assert node in meant_for, f"{example}: pod {pod} on {node}, meant for {meant_for}"
        claims = claims_of(cluster, namespace, pod)
        assert claims
        for claim in claims:
            results = claim["status"]["allocation"]["devices"]["results"]
            assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER, node)}, results
            if example == "memory-share.yaml":
                assert [r.get("consumedCapacity") for r in results] == [{"memory": "10Gi"}]


@pytest.mark.parametrize(("resource", "configured"), [
    ("nvidia.com/gpu", True), ("gpu.nodeagent.dev/gpu", True),
    # Every class's implicit name (KEP-5004), with nothing configured.
    ("deviceclass.resource.kubernetes.io/gpu.nodeagent.dev", False)])
def test_legacy_pod_gets_gpus_through_dra(resource: str, configured: bool,
                                          cluster: Cluster) -> None:
    """With ``extendedResourceName`` on the shipped gpu.nodeagent.dev class (or its implicit
    name), an unchanged pod asking for ``resources.limits: {<name>: 2}`` is bound to a node
    whose allocatable has no such resource: kube-scheduler creates a claim of its own for
    two whole GPUs of that node, names it in ``status.extendedResourceClaimStatus``, and
    kubelet's DRA manager prepares it through the plugin (two CDI devices for the
    container)."""
    server = cluster.server
    if configured:
        server.kubectl("patch", "deviceclass", "gpu.nodeagent.dev", "--type=merge", "-p",
                       json.dumps({"spec": {"extendedResourceName": resource}}))
    namespace = "legacy-" + resource.replace("/", "-").replace(".", "-")[-40:]
    ensure_namespace(server, namespace)
    try:
        create(server, f"/api/v1/namespaces/{namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cuda"},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "cuda", "image": "nvcr.io/nvidia/cuda:12.9.1-base-ubi9",
                "command": ["nvidia-smi", "-L"], "resources": {"limits": {resource: "2"}}}]}})
        node = bound_node(cluster, namespace, "cuda")
        _, pod = server.request("GET", f"/api/v1/namespaces/{namespace}/pods/cuda")
        extended = pod["status"]["extendedResourceClaimStatus"]
        assert [m["containerName"] for m in extended["requestMappings"]] == ["cuda"]
        assert [m["resourceName"] for m in extended["requestMappings"]] == [resource]
        (claim,) = claims_of(cluster, namespace, "cuda")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 2 and {(r["driver"], r["pool"]) for r in results} == {
            (DRIVER, node)}, results
        assert len({r["device"] for r in results}) == 2
        kubelet = cluster.stacks[node].kubelet
        assert kubelet is not None
        prepared = kubelet.prepare(f"{namespace}/cuda")
        assert prepared["ok"], f"{prepared}\n{cluster.stacks[node].plugin.log()}"
        assert len(prepared["containers"]["cuda"]) == 2, prepared
        unprepared = kubelet.unprepare(f"{namespace}/cuda")
        assert unprepared["ok"], unprepared
    finally:
        if configured:
            server.kubectl("patch", "deviceclass", "gpu.nodeagent.dev", "--type=json", "-p",
                           '[{"op": "remove", "path": "/spec/extendedResourceName"}]')
