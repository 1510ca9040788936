"""``gpu-agent mps-host`` refuses to start on a configuration it cannot serve, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.mps.direct import DirectLauncher
from agent.mps.host_client import HostLauncher, launcher_for

from .processes import ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "mps-host", *args],
                          capture_output=True, text=True, timeout=30, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize(("flags", "said"), [
    ((), "--mps-root is required"),
    (("--mps-root", "/run/x"), "--mps-control is required"),
    (("--mps-root", "/run/x", "--mps-control", "/nonexistent/mps"), "not an executable"),
    (("--mps-root", "/run/x", "--mps-control", "/bin/sh", "--socket-group", "no-such-grp"),
     "no group 'no-such-grp'"),
    (("--mps-root", "/run/x", "--mps-control", "/bin/sh", "--imex", "/bin/sh"),
     "--imex and --imex-root go together"),
    (("--mps-root", "/run/x", "--mps-control", "/bin/sh", "--imex-root", "/run/imex"),
     "--imex and --imex-root go together"),
])
def test_a_configuration_it_cannot_serve_exits_2_saying_why(
        tmp_path: Path, flags: tuple[str, ...], said: str) -> None:
    """Missing or unusable flags: exit 2 with the reason, and no socket is bound."""
    done = _run("--socket", str(tmp_path / "host.sock"), *flags)
    assert done.returncode == 2 and said in done.stderr
    assert not (tmp_path / "host.sock").exists()


def test_the_settings_choose_the_launcher(tmp_path: Path) -> None:
    """With --mps-host-socket the agent asks the host; without, it starts daemons itself."""
    host = launcher_for(tmp_path / "host.sock")
    assert isinstance(host, HostLauncher) and str(tmp_path / "host.sock") in host.describe()
    assert isinstance(launcher_for(None), DirectLauncher)
