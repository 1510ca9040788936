"""The IMEX daemon starts in a mount namespace of its own whose /etc/hosts is the domain's
hosts file (the node's stays as it is), with the argv the agent finds it by; a rewrite of
that file in place reaches a running daemon; what cannot be started is ImexUnavailable
naming why, and ImexControl signals only the daemon of its config."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from pathlib import Path

import pytest

from agent.domains.service import rewrite_in_place
from agent.errors import ImexUnavailable
from agent.gpu.imex import ImexControl
from agent.mps.direct import DirectLauncher
from tests.processes import starts_processes
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")

#: Stands in for nvidia-imex: records its argv and /etc/hosts, leaves a daemon running in
#: its namespace as a DAEMONIZE=1 start does (argv ``nvidia-imex -c <config>``; it notes
#: each SIGUSR1) and exits once that daemon handles signals.
FAKE = """#!/bin/sh
printf '%s\\n' "$0" "$@" > "$2.argv"
cat /etc/hosts > "$2.seen"
sh -c 'trap "echo usr1 >> $2.usr1" USR1; : > $2.up; while :; do sleep 0.1; done' \\
    nvidia-imex -c "$2" </dev/null >/dev/null 2>&1 &
echo $! > "$2.pid"
while [ ! -e "$2.up" ]; do sleep 0.01; done
echo started
"""


@pytest.fixture
def launcher() -> DirectLauncher:
    return DirectLauncher()


@pytest.fixture
@starts_processes  # the fake daemon's tests launch it
def imex(tmp_path: Path) -> Path:
    path = tmp_path / "nvidia-imex"
    path.write_text(FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_daemon_sees_the_hosts_file_at_etc_hosts_and_its_rewrites(
        tmp_path: Path, imex: Path, launcher: DirectLauncher) -> None:
    config, hosts = tmp_path / "config.cfg", tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.7 imex-a-0000\n")
    node_hosts = Path("/etc/hosts").read_bytes()
    done = asyncio.run(launcher.launch_imex(str(imex), str(config), str(hosts),
                                            timeout_s=10))
    assert (done.returncode, done.output) == (0, "started\n")
    pid = int(Path(f"{config}.pid").read_text())
    try:
        assert Path(f"{config}.argv").read_text().splitlines() == [str(imex), "-c",
                                                                   str(config)]
        assert Path(f"{config}.seen").read_text() == hosts.read_text()
        assert Path("/etc/hosts").read_bytes() == node_hosts
        inside = Path(f"/proc/{pid}/root/etc/hosts")
        rewrite_in_place(hosts, b"127.0.0.1 localhost\n10.0.0.8 imex-a-0000\n")
        assert inside.read_text() == "127.0.0.1 localhost\n10.0.0.8 imex-a-0000\n"
        with pytest.raises(OSError):  # read-only for the daemon
            inside.write_text("")
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_start_that_cannot_run_is_imex_unavailable_naming_why(
        tmp_path: Path, imex: Path, launcher: DirectLauncher) -> None:
    config, hosts = tmp_path / "config.cfg", tmp_path / "hosts"
    with pytest.raises(ImexUnavailable) as missing:
        asyncio.run(launcher.launch_imex(str(imex), str(config), str(hosts), timeout_s=10))
    assert missing.value.reason == "no namespace" and str(hosts) in missing.value.detail
    (tmp_path / "elsewhere").write_text("10.0.0.9 imex-a-0000\n")
    hosts.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ImexUnavailable) as linked:  # never followed
        asyncio.run(launcher.launch_imex(str(imex), str(config), str(hosts), timeout_s=10))
    assert "hosts" in linked.value.detail
    real = tmp_path / "real-hosts"
    real.write_text("127.0.0.1 localhost\n")
    with pytest.raises(ImexUnavailable) as absent:
        asyncio.run(launcher.launch_imex(str(tmp_path / "no-imex"), str(config), str(real),
                                         timeout_s=10))
    assert "cannot run" in absent.value.detail


def test_imex_control_starts_through_its_launcher_and_signals_only_its_daemon(
        tmp_path: Path, imex: Path, launcher: DirectLauncher) -> None:
    ctl = tmp_path / "nvidia-imex-ctl"
    ctl.write_text("#!/bin/sh\nexit 0\n")
    ctl.chmod(0o755)
    config, hosts = tmp_path / "config.cfg", tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    control = ImexControl(imex, ctl, launcher)
    asyncio.run(control.start(config, hosts))
    pid = int(Path(f"{config}.pid").read_text())
    try:
        assert control.runs(pid, config) and control.find(config) == pid
        assert control.reconnect(pid, config) is True
        wait_for(lambda: Path(f"{config}.usr1").is_file(), "the daemon to note SIGUSR1")
        assert control.reconnect(pid, tmp_path / "other.cfg") is False  # not its daemon
        assert control.reconnect(os.getpid(), config) is False
    finally:
        os.kill(pid, signal.SIGKILL)
    imex.write_text("#!/bin/sh\necho 'no driver' >&2\nexit 3\n")
    with pytest.raises(ImexUnavailable) as failed:
        asyncio.run(control.start(config, hosts))
    assert failed.value.reason == "start failed" and "exited 3: no driver" in \
        failed.value.detail
