from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.cdi.conftest import cdi_checker  # noqa: F401 - shared with the CDI tests


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One simulated DGX H100 agent shared by a module's read-mostly tests."""
    agent = start_agent(tmp_path_factory.mktemp("h100") / "state")
    yield agent
    agent.stop(signal.SIGKILL)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"
