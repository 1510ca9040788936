"""The link graph of each preset: matrix cells, bandwidths, islands; the NVSwitch and
asymmetry rules on hand-made discovery results; the topo -m text."""

from __future__ import annotations

import pytest

from agent.gpu.topology import GpuLinks, NodeLinks, NvLink
from agent.topology.bandwidth import nvlink_gb_s, pcie_gb_s
from agent.topology.graph import TopologyGraph, build_graph
from agent.topology.matrix import render

BRIDGES = {(0, 2), (1, 3), (4, 5), (6, 7)}


def test_dgx_h100_is_one_nv18_island(graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: NV18 on every pair, one island, 450 GB/s per pair and per GPU."""
    graph = graphs["dgx-h100"]
    matrix = graph.matrix()
    for a in range(8):
        for b in range(8):
            assert matrix[a][b] == ("X" if a == b else "NV18")
            if a != b:
                assert graph.bandwidth[a][b] == 450.0
    assert graph.islands() == [list(range(8))]
    assert {g.nvlink_gb_s for g in graph.gpus} == {450.0}


@pytest.mark.parametrize(("preset", "cell"), [("dgx-a100", "NV12"), ("hgx-h200", "NV18")])
def test_other_nvswitch_boards(graphs: dict[str, TopologyGraph], preset: str, cell: str) -> None:
    graph = graphs[preset]
    assert {graph.cell(a, b) for a in range(8) for b in range(8) if a != b} == {cell}
    assert graph.islands() == [list(range(8))]


def test_bridged_a100_has_four_nv12_islands(graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: NV12 on 0-2, 1-3, 4-5, 6-7, NODE within a socket and SYS across, four
    islands; bridged pairs carry 300 GB/s, PCIe Gen4 x16 pairs 31.5."""
    graph = graphs["a100-pcie-bridged"]
    for a in range(8):
        for b in range(a + 1, 8):
            same_socket = (a < 4) == (b < 4)
            expected = "NV12" if (a, b) in BRIDGES else "NODE" if same_socket else "SYS"
            assert graph.cell(a, b) == expected == graph.cell(b, a)
            assert graph.bandwidth[a][b] == (300.0 if (a, b) in BRIDGES else 31.504)
    assert graph.islands() == [[0, 2], [1, 3], [4, 5], [6, 7]]


def test_l40s_has_no_nvlink(graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: no NVLink anywhere, no islands."""
    graph = graphs["l40s"]
    assert not any(c.startswith("NV") for row in graph.matrix() for c in row)
    assert graph.islands() == []
    assert graph.matrix()[0] == ["X", "NODE", "SYS", "SYS"]


def test_per_link_bandwidth_table() -> None:
    """NVLink1 20, NVLink2-4 25, NVLink5 50 GB/s per link; PCIe by generation and width."""
    assert [nvlink_gb_s(v) for v in (1, 2, 3, 4, 5, 6, 7)] == [20, 25, 25, 25, 25, 25, 50]
    assert nvlink_gb_s(0) == 25.0
    assert pcie_gb_s(4, 16) == 31.504 and pcie_gb_s(5, 16) == 63.008
    assert pcie_gb_s(3, 8) == 7.88 and pcie_gb_s(None, 16) == 15.76


def _gpu(index: int, links: list[NvLink], bus: int) -> GpuLinks:
    return GpuLinks(index=index, uuid=f"GPU-{index}", pci_bus_id=f"00000000:{bus:02X}:00.0",
                    numa_node=0, cpu_affinity="0-7", links=tuple(links), pcie_generation=4,
                    pcie_width=16)


def _switch(n: int, version: int = 6) -> list[NvLink]:
    return [NvLink(link=i, version=version, p2p=True, remote_type="switch", remote_bus_id="")
            for i in range(n)]


def test_nvswitch_pairs_get_the_smaller_link_count() -> None:
    """A GPU with 18 switch links and one with 12 meet at NV12 (the NCCL/DCGM model);
    a GPU whose links are not P2P-capable does not count."""
    no_p2p = [NvLink(link=i, version=6, p2p=False, remote_type="switch", remote_bus_id="")
              for i in range(18)]
    graph = build_graph(NodeLinks(gpus=(_gpu(0, _switch(18), 1), _gpu(1, _switch(12), 2),
                                        _gpu(2, no_p2p, 3))))
    assert graph.cell(0, 1) == "NV12" and graph.bandwidth[0][1] == 300.0
    assert graph.links[0][2] == 0 and graph.islands() == [[0, 1]]


def test_mixed_versions_use_the_slower_link_rate() -> None:
    """An NVLink5 GPU meeting an NVLink4 one over switches runs at the NVLink4 rate."""
    graph = build_graph(NodeLinks(gpus=(_gpu(0, _switch(18, 7), 1), _gpu(1, _switch(18), 2))))
    assert graph.bandwidth[0][1] == 450.0
    assert graph.gpus[0].nvlink_gb_s == 900.0


def test_direct_links_and_asymmetry() -> None:
    """Direct links count per peer bus id; a disagreement is reported and the smaller used."""
    to_1 = [NvLink(link=i, version=4, p2p=True, remote_type="gpu",
                   remote_bus_id="00000000:02:00.0") for i in range(4)]
    to_0 = [NvLink(link=i, version=4, p2p=True, remote_type="gpu",
                   remote_bus_id="00000000:01:00.0") for i in range(2)]
    graph = build_graph(NodeLinks(gpus=(_gpu(0, to_1, 1), _gpu(1, to_0, 2))))
    assert graph.cell(0, 1) == "NV2"
    assert len(graph.notes) == 1 and "asymmetric" in graph.notes[0]


def test_topo_matrix_text(graphs: dict[str, TopologyGraph]) -> None:
    """The text has nvidia-smi's header, ' X ' on the diagonal, the affinity columns and the
    legend."""
    graph = graphs["a100-pcie-bridged"]
    text = render(graph.matrix(), [g.cpu_affinity for g in graph.gpus],
                  [g.numa_node for g in graph.gpus])
    lines = text.splitlines()
    assert lines[0].split("\t") == ["", *(f"GPU{i}" for i in range(8)), "CPU Affinity",
                                    "NUMA Affinity", "GPU NUMA ID"]
    assert lines[1].split("\t") == ["GPU0", " X ", "NODE", "NV12", "NODE", "SYS", "SYS", "SYS",
                                    "SYS", "0-31,64-95", "0", "N/A"]
    assert "NV#  = Connection traversing a bonded set of # NVLinks" in text
