"""Graphs of the simulated presets, discovered once per preset through the real NVML code."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.gpu.inventory import read_static
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.topology import read_node_links
from agent.topology.graph import TopologyGraph, build_graph


def preset_graph(preset: str, root: Path) -> TopologyGraph:
    node = SimulatedNode(preset, root / "state", root / "proc")
    try:
        node.nvml.nvmlInit()
        session = NvmlSession(node.nvml)
        statics = [read_static(session, i) for i in range(int(session.call("nvmlDeviceGetCount")))]
        graph = build_graph(read_node_links(session, statics, sys_root=node.sys_root))
        session.close()
        return graph
    finally:
        node.close()


@pytest.fixture(scope="session")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TopologyGraph]:
    return {p: preset_graph(p, tmp_path_factory.mktemp(p))
            for p in ("dgx-h100", "dgx-a100", "hgx-h200", "a100-pcie-bridged", "l40s")}
