"""DirectLauncher, the launcher the host uses for every start (and the agent without a
host): exact environment, bounded waits, errors as SharingUnavailable."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.errors import SharingUnavailable
from agent.mps.direct import MAX_OUTPUT, DirectLauncher
from tests.processes import starts_processes


@pytest.fixture
@starts_processes  # every launch is a process start (an exec of a missing binary too)
def launcher() -> DirectLauncher:
    return DirectLauncher()


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tool"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_the_start_gets_exactly_the_environment_given(tmp_path: Path,
        launcher: DirectLauncher) -> None:
    """Nothing of the caller's environment leaks into the start; its exit status and output
    come back."""
    tool = _script(tmp_path, 'env | sort; exit 3')
    result = asyncio.run(launcher.launch([str(tool), "-d"], {"A": "1", "PATH": "/bin"},
                                                 timeout_s=10))
    assert result.returncode == 3
    assert sorted(line.split("=", 1)[0] for line in result.output.split()) == \
        ["A", "PATH", "PWD"]  # PWD: set by the shell itself


def test_a_start_that_does_not_exit_in_time_is_killed_and_reported(tmp_path: Path,
        launcher: DirectLauncher) -> None:
    """A start hanging past its timeout is killed with its process group and reported as
    SharingUnavailable (reason timeout) with what it printed."""
    marker = tmp_path / "still-running"
    tool = _script(tmp_path, f'echo waiting; sleep 30; touch {marker}')
    with pytest.raises(SharingUnavailable) as err:
        asyncio.run(launcher.launch([str(tool)], {"PATH": "/bin:/usr/bin"},
                                            timeout_s=0.5))
    assert err.value.reason == "timeout" and "waiting" in err.value.detail
    assert not marker.exists()


def test_a_missing_binary_is_sharing_unavailable(tmp_path: Path,
        launcher: DirectLauncher) -> None:
    """A binary that is not there fails the launch with the path in the message."""
    with pytest.raises(SharingUnavailable) as err:
        asyncio.run(launcher.launch([str(tmp_path / "nope"), "-d"], {}, timeout_s=5))
    assert str(tmp_path / "nope") in err.value.detail


def test_output_is_truncated(tmp_path: Path,
        launcher: DirectLauncher) -> None:
    """A chatty start's output is cut at MAX_OUTPUT characters (plus an ellipsis)."""
    tool = _script(tmp_path, "i=0; while [ $i -lt 2000 ]; do echo 0123456789; i=$((i+1)); done")
    result = asyncio.run(launcher.launch([str(tool)], {"PATH": "/bin"}, timeout_s=10))
    assert len(result.output) == MAX_OUTPUT + 1 and result.output.endswith("…")


def test_describe_says_daemons_die_with_the_caller_s_cgroup() -> None:
    """describe() tells operators a direct daemon is not restart-safe."""
    assert "cgroup" in DirectLauncher().describe()
