"""Choosing sets on the preset graphs: the done-when answers, exclusions and errors."""

from __future__ import annotations

import pytest

from agent.errors import Conflict, InvalidRequest
from agent.topology.graph import TopologyGraph, graph_from_matrix
from agent.topology.select import select

PAIRS = {(0, 2), (1, 3), (4, 5), (6, 7)}


def test_bridged_pair_for_two(graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: count=2 returns a bridged pair over NVLink."""
    chosen = select(graphs["a100-pcie-bridged"], 2)
    assert chosen.gpus in PAIRS
    assert chosen.bottleneck_link == "nvlink" and chosen.bottleneck_gb_s == 300.0
    assert chosen.optimal


def test_two_bridged_pairs_on_one_numa_node_for_four(graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: count=4 returns two bridged pairs on one NUMA node."""
    chosen = select(graphs["a100-pcie-bridged"], 4)
    inside = {p for p in PAIRS if set(p) <= set(chosen.gpus)}
    assert len(inside) == 2 and len(chosen.numa_nodes) == 1


def test_unhealthy_partner_makes_the_bottleneck_pcie_and_it_says_so(
        graphs: dict[str, TopologyGraph]) -> None:
    """Done-when: GPU 2 unhealthy, count=2 with GPU 0: a PCIe pair on GPU 0's NUMA node; the
    answer names PCIe, and GPU 2 as the NVLink peer left out."""
    chosen = select(graphs["a100-pcie-bridged"], 2, must_include=[0],
                    unavailable={2: "unhealthy: XID 79"})
    assert 0 in chosen.gpus and 2 not in chosen.gpus
    assert chosen.bottleneck_link == "pcie" and chosen.bottleneck_gb_s == 31.504
    assert chosen.numa_nodes == (0,)
    assert "PCIe" in chosen.explanation and "GPU 2 (unhealthy: XID 79)" in chosen.explanation


def test_nvswitch_board_keeps_a_set_on_one_socket(graphs: dict[str, TopologyGraph]) -> None:
    """All pairs are NV18, so NUMA locality decides: four GPUs of one socket."""
    chosen = select(graphs["dgx-h100"], 4)
    assert chosen.bottleneck_gb_s == 450.0 and chosen.total_gb_s == 2700.0
    assert len(chosen.numa_nodes) == 1


def test_candidates_limit_the_choice(graphs: dict[str, TopologyGraph]) -> None:
    chosen = select(graphs["a100-pcie-bridged"], 2, candidates=[0, 1, 3, 6])
    assert chosen.gpus == (1, 3)


def test_errors(graphs: dict[str, TopologyGraph]) -> None:
    """Too many GPUs asked, an unavailable must-include, more must-includes than count and
    unknown GPUs are refused with the reason; nothing is guessed."""
    graph = graphs["l40s"]
    with pytest.raises(Conflict, match="only 3 can be chosen"):
        select(graph, 4, unavailable={1: "split by MIG"})
    with pytest.raises(Conflict, match="GPU 1: held by claim c1"):
        select(graph, 2, must_include=[1], unavailable={1: "held by claim c1"})
    with pytest.raises(InvalidRequest):
        select(graph, 1, must_include=[0, 1])
    with pytest.raises(InvalidRequest):
        select(graph, 1, candidates=[9])
    with pytest.raises(InvalidRequest):
        select(graph, 1, candidates=[1], must_include=[0])


def test_greedy_answers_above_the_exact_limit() -> None:
    """An irregular 40-GPU board: the heuristic answers, says it may not be optimal, and still
    finds an NVLink-only set where one exists."""
    n = 40
    links = [[0] * n for _ in range(n)]
    for a in range(0, n, 4):  # islands of four fully meshed GPUs with uneven link counts
        for x in range(a, a + 4):
            for y in range(a, a + 4):
                if x != y:
                    links[x][y] = 2 + (x + y + a) % 5
    levels = [["SYS"] * n for _ in range(n)]
    graph = graph_from_matrix(links, levels, [i // 20 for i in range(n)])
    chosen = select(graph, 4)
    assert (chosen.method, chosen.optimal) == ("greedy", False)
    assert "may not be optimal" in chosen.explanation
    assert chosen.bottleneck_link == "nvlink"
    chosen = select(graph, 12)
    assert len(chosen.gpus) == 12 and chosen.method == "greedy"
