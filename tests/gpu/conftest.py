"""The hardware layer over a simulated node: the same NvmlSession code a real node runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode

SessionFactory = Callable[[str], tuple[SimulatedNode, NvmlSession]]


@pytest.fixture
def open_session(tmp_path: Path) -> Iterator[SessionFactory]:
    opened: list[tuple[SimulatedNode, NvmlSession]] = []

    def make(preset: str) -> tuple[SimulatedNode, NvmlSession]:
        node = SimulatedNode(preset, tmp_path / f"state-{len(opened)}",
                             tmp_path / f"proc-{len(opened)}")
        pair = (node, NvmlSession(node.nvml))
        opened.append(pair)
        return pair

    yield make
    for node, session in opened:
        session.close()
        node.close()
