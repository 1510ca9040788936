"""Topology discovery through NVML against the simulated presets: what each link says, the
PCIe ancestors, the fabric clique rule, sysfs roots, and robustness to what real nodes do (links
that are not there, asymmetric answers, lost GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.gpu.inventory import read_static
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.topology import (
    NodeLinks,
    normalise_bus_id,
    pcie_root,
    read_node_links,
    sysfs_bus_id,
)
from agent.gpu.types import Fabric
from agent.topology.graph import build_graph

Discover = Callable[[SimulatedNode], NodeLinks]


@pytest.fixture
def open_node(tmp_path: Path) -> Iterator[Callable[[str], SimulatedNode]]:
    nodes: list[SimulatedNode] = []

    def make(preset: str) -> SimulatedNode:
        node = SimulatedNode(preset, tmp_path / f"s{len(nodes)}", tmp_path / f"p{len(nodes)}")
        node.nvml.nvmlInit()
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def discover(node: SimulatedNode) -> NodeLinks:
    session = NvmlSession(node.nvml)
    try:
        count = int(session.call("nvmlDeviceGetCount"))
        statics = [read_static(session, i) for i in range(count)]
        return read_node_links(session, statics, sys_root=node.sys_root)
    finally:
        session.close()


def test_dgx_h100_links_reach_four_nvswitches(open_node: Callable[[str], SimulatedNode]) -> None:
    """Every H100 has 18 active NVLink 4.0 links, all P2P, all to NVSwitches (5, 5, 4, 4
    links to the four switches), and every pair has a PCIe ancestor level."""
    links = discover(open_node("dgx-h100"))
    for gpu in links.gpus:
        assert gpu.error is None
        assert len(gpu.links) == 18
        assert {(link.remote_type, link.version, link.p2p) for link in gpu.links} == {
            ("switch", 6, True)}
        assert all(link.remote_bus_id == "" for link in gpu.links)  # switches are not asked
        assert (gpu.pcie_generation, gpu.pcie_width) == (5, 16)
    assert len(links.ancestors) == 28
    assert links.ancestors[(0, 1)] == 40 and links.ancestors[(0, 4)] == 50
    assert links.problems == ()


def test_bridged_a100_links_name_their_peer(open_node: Callable[[str], SimulatedNode]) -> None:
    """On the bridged A100 PCIe node each GPU's 12 links end at its bridge partner's bus."""
    node = open_node("a100-pcie-bridged")
    links = discover(node)
    buses = [g.pci_bus_id for g in links.gpus]
    for a, b in ((0, 2), (1, 3), (4, 5), (6, 7)):
        for x, y in ((a, b), (b, a)):
            gpu = links.gpus[x]
            assert len(gpu.links) == 12
            assert {(link.remote_type, link.remote_bus_id) for link in gpu.links} == {
                ("gpu", normalise_bus_id(buses[y]))}


def test_l40s_has_no_nvlink(open_node: Callable[[str], SimulatedNode]) -> None:
    links = discover(open_node("l40s"))
    assert all(g.links == () and g.error is None for g in links.gpus)
    assert links.problems == ()


def test_pcie_root_comes_from_sysfs(open_node: Callable[[str], SimulatedNode],
                                    tmp_path: Path) -> None:
    """The root complex is read from where /sys/bus/pci/devices/<BDF> points; GPUs sharing a
    PCIe switch (DGX A100 pairs) share it; no sysfs entry means no root."""
    node = open_node("dgx-a100")
    links = discover(node)
    roots = [g.pcie_root for g in links.gpus]
    assert all(r is not None and r.startswith("pci0000:") for r in roots)
    assert roots[0] == roots[1] and roots[0] != roots[2]
    assert pcie_root(tmp_path / "nothing", links.gpus[0].pci_bus_id) is None
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"


def test_skipped_links_make_asymmetric_pairs_use_the_smaller_side(
        open_node: Callable[[str], SimulatedNode]) -> None:
    """Three links of GPU 0 answer NOT_SUPPORTED: they are skipped silently; GPU 0 sees 9
    links to GPU 2, GPU 2 sees 12; the graph reports the asymmetry and uses NV9."""
    node = open_node("a100-pcie-bridged")
    node.add_fault("nvmlDeviceGetNvLinkState", "NVML_ERROR_NOT_SUPPORTED",
                   gpu=node.gpu_uuids()[0], times=3)
    links = discover(node)
    assert len(links.gpus[0].links) == 9 and len(links.gpus[2].links) == 12
    assert links.problems == ()
    graph = build_graph(links)
    assert graph.cell(0, 2) == "NV9" == graph.cell(2, 0)
    assert any("asymmetric" in note and "GPUs 0-2" in note for note in graph.notes)


def test_unexpected_link_error_skips_that_link_only(
        open_node: Callable[[str], SimulatedNode]) -> None:
    """An UNKNOWN error on one link's remote type loses only that link's type; it is
    reported, and the other 17 links and GPUs are intact."""
    node = open_node("dgx-h100")
    node.add_fault("nvmlDeviceGetNvLinkRemoteDeviceType", "NVML_ERROR_UNKNOWN",
                   gpu=node.gpu_uuids()[3])
    links = discover(node)
    assert len(links.gpus[3].links) == 18
    assert any("GPU 3" in p and "NVML_ERROR_UNKNOWN" in p for p in links.problems)
    graph = build_graph(links)
    assert graph.cell(3, 5) == "NV18"


def test_missing_remote_type_call_falls_back_to_bus_ids(
        open_node: Callable[[str], SimulatedNode]) -> None:
    """Drivers without nvmlDeviceGetNvLinkRemoteDeviceType: a remote bus that is one of our
    GPUs is a GPU, anything else a switch (as NCCL assumes)."""
    bridged = open_node("a100-pcie-bridged")
    bridged.add_fault("nvmlDeviceGetNvLinkRemoteDeviceType", "NVML_ERROR_FUNCTION_NOT_FOUND",
                      times=1000)
    assert build_graph(discover(bridged)).cell(0, 2) == "NV12"
    switched = open_node("dgx-h100")
    switched.add_fault("nvmlDeviceGetNvLinkRemoteDeviceType", "NVML_ERROR_FUNCTION_NOT_FOUND",
                       times=1000)
    links = discover(switched)
    assert {link.remote_type for g in links.gpus for link in g.links} == {"switch"}
    assert build_graph(links).cell(0, 7) == "NV18"


def test_lost_gpu_loses_only_its_own_data(open_node: Callable[[str], SimulatedNode]) -> None:
    """GPU 2 fell off the bus (XID 79) before discovery: it has an error and no links, its
    bridge partner's links to it are reported asymmetric (0 used), the rest is intact."""
    node = open_node("a100-pcie-bridged")
    node.inject_xid(node.gpu_uuids()[2], 79)
    links = discover(node)
    assert links.gpus[2].error is not None and links.gpus[2].links == ()
    assert all(g.error is None for g in links.gpus if g.index != 2)
    assert (0, 2) not in links.ancestors and (0, 1) in links.ancestors
    graph = build_graph(links)
    assert graph.cell(0, 2) != "NV12"
    assert graph.cell(4, 5) == "NV12"


def test_gpu_lost_mid_walk_stops_that_gpu(open_node: Callable[[str], SimulatedNode]) -> None:
    """GPU_IS_LOST from a link call ends the walk of that GPU; the others finish."""
    node = open_node("dgx-h100")
    node.add_fault("nvmlDeviceGetNvLinkVersion", "NVML_ERROR_GPU_IS_LOST",
                   gpu=node.gpu_uuids()[5], skip=4)
    links = discover(node)
    assert links.gpus[5].error is not None and "lost" in links.gpus[5].error
    assert sum(1 for g in links.gpus if g.error is None and len(g.links) == 18) == 7


@pytest.mark.parametrize(("state", "status", "uuid", "clique"), [
    (3, 0, "9c6f5af3-0000-0000-0000-000000000001", "9c6f5af3-0000-0000-0000-000000000001.7"),
    (2, 0, "9c6f5af3-0000-0000-0000-000000000001", None),
    (3, 6, "9c6f5af3-0000-0000-0000-000000000001", None),
    (3, 0, "00000000-0000-0000-0000-000000000000", None),
])
def test_fabric_clique_rule(state: int, status: int, uuid: str, clique: str | None) -> None:
    """Only a COMPLETED fabric with SUCCESS and a non-zero cluster UUID has a clique."""
    assert Fabric(cluster_uuid=uuid, clique_id=7, state=state, status=status).clique == clique
