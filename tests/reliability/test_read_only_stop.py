"""A state directory that stops taking writes under a running agent (issue 22, item 8): the
directory bind-mounted read-only over itself, then SIGTERM. The agent stops cleanly (exit 0,
no traceback), with one warning for each file it could not remove or write, naming it."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_process import start_agent


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The state directory; unmounted at the end if a test made it read-only."""
    state = tmp_path / "state"
    state.mkdir()
    yield state
    subprocess.run(["umount", "-l", str(state)], capture_output=True, check=False)


def _make_read_only(directory: Path) -> None:
    """Bind-mount ``directory`` read-only over itself (as root, where CI runs: chmod does not
    stop root's writes)."""
    for args in (["--bind", str(directory), str(directory)],
                 ["-o", "remount,bind,ro", str(directory)]):
        done = _mount(*args)
        if done.returncode != 0:
            if os.environ.get("CI"):
                pytest.fail(f"cannot bind-mount read-only in CI: {done.stderr}")
            pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
    with pytest.raises(OSError):
        (directory / "probe").write_text("x")


def test_sigterm_with_a_read_only_state_directory_stops_cleanly(state_dir: Path) -> None:
    """SIGTERM after the state directory went read-only: exit 0, no traceback, and every
    warning from the stop names the file it concerns, listeners.json exactly once."""
    agent = start_agent(state_dir)
    assert agent.request("GET", "/v1/gpus").status == 200
    _make_read_only(state_dir)
    code = agent.stop()
    log = agent.log()
    assert "Traceback" not in log, log[-4000:]
    assert code == 0, log[-4000:]
    stop = log[log.index("msg=stopping"):]
    warnings = [line for line in stop.splitlines() if "level=warning" in line]
    assert warnings, stop
    for line in warnings:
        assert re.search(rf"{re.escape(str(state_dir))}/\S+", line), line
    named = [line for line in warnings if "listeners.json" in line]
    assert len(named) == 1, warnings
    assert (state_dir / "listeners.json").exists()  # left behind, as the warning says
