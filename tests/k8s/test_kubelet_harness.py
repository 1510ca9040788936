"""Kubelet's own DRA code (tests/k8s k8s-harness kubelet) against a real API server, and the
CDI reference library resolving what the agent's claims hand to the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import StartApiServer, StartKubelet
from tests.k8s.harness import NEWEST, SLICE_RULES, VERSIONS, ApiServer, allocate_in_cluster
from tests.k8s.objects import DRIVER, claim, classes, pod, request
from tests.k8s.published import set_mig, slices_of
from tests.waiting import wait_for

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _node_slices(server: ApiServer, node_name: str) -> list[str]:
    status, body = server.request("GET", f"{SLICES}?fieldSelector=spec.nodeName={node_name}")
    assert status == 200, body
    return [s["metadata"]["name"] for s in body["items"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_kubelet_start_wipes_only_its_own_nodes_slices(
        version: str, kube_apiservers: StartApiServer, kubelet_harness: StartKubelet,
        agent_node: StartAgent) -> None:
    """Starting kubelet's DRA manager deletes every ResourceSlice of its node, as a kubelet
    restart does (publishers must republish), and leaves other nodes' slices alone."""
    server = kube_apiservers(version)
    mine, other = f"wipe-mine-{version}".replace(".", "-"), f"wipe-other-{version}".replace(
        ".", "-")
    for name in (mine, other):
        server.ensure_node(name)
        agent = agent_node("l40s", node_name=name)
        for item in slices_of(agent, SLICE_RULES[version]):
            assert server.request("POST", SLICES, item)[0] == 201
    assert _node_slices(server, mine) and _node_slices(server, other)

    kubelet_harness(server, node=mine)
    wait_for(lambda: _node_slices(server, mine) == [], f"kubelet to wipe {mine}'s slices", 30,
             every_s=0.2)
    assert _node_slices(server, other) != []


@pytest.mark.parametrize("version", VERSIONS)
def test_allocated_claim_reaches_kubelet_and_stops_at_the_missing_driver(
        version: str, kube_apiservers: StartApiServer, kubelet_harness: StartKubelet,
        agent_node: StartAgent) -> None:
    """A claim allocated in the server (status.allocation, reservedFor the pod, as the
    scheduler writes them) passes kubelet's own checks and fails prepare only because no
    plugin registered for the agent's driver."""
    server = kube_apiservers(version)
    name = f"reach-{version}".replace(".", "-")
    server.ensure_node(name)
    agent = agent_node("dgx-h100", node_name=name)
    for item in slices_of(agent, SLICE_RULES[version]):
        assert server.request("POST", SLICES, item)[0] == 201
    for device_class in classes():
        server.kubectl("apply", "-f", "-", stdin=json.dumps(device_class))
    wanted = claim(name, request(count=2))
    wanted["metadata"].pop("uid")
    server.apply([wanted, pod(name, {"gpu": name}, node_name=name)])

    answer = allocate_in_cluster(server, node=name, claims=[f"default/{name}"],
                                 pod=f"default/{name}")
    assert answer.allocated and answer.devices() == ["gpu-0", "gpu-1"]
    status, stored = server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}")
    assert status == 200
    assert [r["device"] for r in stored["status"]["allocation"]["devices"]["results"]] == [
        "gpu-0", "gpu-1"]
    assert [r["name"] for r in stored["status"]["reservedFor"]] == [name]

    kubelet = kubelet_harness(server, node=name)
    prepared = kubelet.prepare(f"default/{name}", timeout=10)
    assert prepared["ok"] is False
    assert f"DRA driver {DRIVER} is not registered" in prepared["error"]


# (what, claim devices, MIG geometry applied first: gpu -> profiles)
CDI_CASES: list[tuple[str, list[dict[str, str]], dict[int, list[str]]]] = [
    ("whole-GPU", [{"kind": "gpu", "device": "gpu-2"}], {}),
    ("two-GPUs", [{"kind": "gpu", "device": "gpu-0"}, {"kind": "gpu", "device": "gpu-5"}],
     {}),
    ("static-MIG", [{"kind": "gpu", "device": "gpu-1-mig-1g10gb-19-0"}],
     {1: ["1g.10gb"] * 7}),
]


@pytest.mark.parametrize("case", CDI_CASES, ids=[c[0] for c in CDI_CASES])
def test_agent_cdi_ids_resolve_and_inject_with_the_reference_library(
        case: tuple[str, list[dict[str, str]], dict[int, list[str]]],
        kube_apiservers: StartApiServer, kubelet_harness: StartKubelet,
        agent_node: StartAgent) -> None:
    """Every CDI device ID an agent claim answers resolves in the agent's CDI directory with
    tags.cncf.io/container-device-interface, every spec there loads, and the injected OCI spec
    gets the claim's own /dev/nvidiaN (or MIG capability) nodes plus the control nodes."""
    what, devices, geometry = case
    agent = agent_node("dgx-h100", node_name="cdi-node")
    for gpu, profiles in geometry.items():
        set_mig(agent, gpu, profiles)
    reply = agent.request("PUT", "/v1/claims/cdi-1", {"devices": devices})
    assert reply.status == 200, reply.body
    ids = [i for d in reply.body["devices"] for i in d["cdi_devices"]]
    kubelet = kubelet_harness(kube_apiservers(NEWEST), node="cdi-node")

    injected = kubelet.cdi_inject(ids, [Path(reply.body["cdi_spec"]).parent])
    assert injected["ok"] is True, injected
    assert injected["unresolved"] == [] and "inject_error" not in injected, injected
    assert injected["spec_errors"] == {}
    paths = {n["path"] for n in injected["device_nodes"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths
    # Device names carry the GPU's minor number: gpu-<minor>[-mig-...].
    minors = {"/dev/nvidia" + d["device"].split("-")[1] for d in devices}
    assert minors <= paths, (what, paths)
    if geometry:
        assert any(p.startswith("/dev/nvidia-caps/") for p in paths), paths
