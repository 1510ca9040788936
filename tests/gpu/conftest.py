"""The hardware layer over a simulated node: the same NvmlSession code a real node runs."""

from __future__ import annotations

import contextlib
import os
import signal
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


def _daemon_pids(root: Path) -> list[int]:
    """Pids of simulated MPS control daemons whose pid files lie under ``root``."""
    pids = []
    for pid_file in root.rglob("nvidia-cuda-mps-control.pid"):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"agent.gpu.sim.mps_control" in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture
def reap_daemons(tmp_path: Path) -> Iterator[Callable[[int], None]]:
    """Kills, at the end of the test, every simulated MPS daemon started under tmp_path
    (and any pid handed to the yielded function): no test leaves a daemon running."""
    extra: list[int] = []
    yield extra.append
    for pid in {*_daemon_pids(tmp_path), *extra}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
