"""Fixtures for the MPS host's tests. ``mps_control`` is the daemon binary: the stand-in of
processes.py until the simulator's nvidia-cuda-mps-control replaces it (one fixture to swap;
the tests that read what the stand-in records, its environment and its /dev/shm probe, keep
the stand-in)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .processes import HostProcess, start_host, stop_daemons, write_stand_in


@pytest.fixture
def mps_control(tmp_path: Path) -> Path:
    """The nvidia-cuda-mps-control the host is configured with."""
    return write_stand_in(tmp_path / "nvidia-cuda-mps-control")


@pytest.fixture
def mps_root(tmp_path: Path) -> Iterator[Path]:
    """The MPS root; every daemon started under it is killed afterwards."""
    root = tmp_path / "mps"
    root.mkdir()
    yield root
    stop_daemons(root)


@pytest.fixture
def host(tmp_path: Path, mps_root: Path, mps_control: Path) -> Iterator[HostProcess]:
    """A running ``gpu-agent mps-host`` on ``<tmp>/host.sock`` (its own process group)."""
    process = start_host(tmp_path, mps_root=mps_root, mps_control=mps_control)
    yield process
    process.stop()
