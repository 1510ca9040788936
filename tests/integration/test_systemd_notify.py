"""The sd_notify protocol of a real agent process against a real datagram socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

pytest.importorskip("systemd.daemon", reason="systemd-python (the systemd extra) is needed")


@dataclass
class NotifySocket:
    """A bound AF_UNIX datagram socket playing systemd's part; records (time, pid, fields)."""

    path: Path
    sock: socket.socket
    messages: list[tuple[float, int, dict[str, str]]] = field(default_factory=list)
    on_ready: list[object] = field(default_factory=list)
    agent: AgentProcess | None = None
    stopped: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        self.sock.settimeout(0.1)
        space = socket.CMSG_SPACE(struct.calcsize("3i"))
        while not self.stopped.is_set():
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, space)
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            if "READY" in fields and self.agent is not None:
                # What /readyz says at the moment systemd would learn READY=1.
                self.on_ready.append(self.agent.request("GET", "/readyz", token=None).status)
            self.messages.append((time.monotonic(), pid, fields))

    def with_key(self, key: str) -> list[tuple[float, int, dict[str, str]]]:
        return [m for m in list(self.messages) if key in m[2]]

    def wait_for(self, key: str, timeout: float = 20) -> tuple[float, int, dict[str, str]]:
        """The first message with ``key``."""
        return wait_for(lambda: self.with_key(key), f"a {key}= message", timeout)[0]


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    # sun_path is short (108 bytes): pytest's tmp_path can be longer than that.
    directory = Path(tempfile.mkdtemp(prefix="sdn-"))
    path = directory / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    listener = NotifySocket(path, sock)
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    yield listener
    listener.stopped.set()
    thread.join(2)
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


def _env(notify: NotifySocket, **extra: str) -> dict[str, str]:
    return {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "300000", **extra}


def test_ready_after_reconciliation_watchdog_and_stopping(tmp_path: Path,
                                                          notify_socket: NotifySocket) -> None:
    # nvmlInit fails twice first: the agent is up, unready, for over a second.
    faults = [{"function": "nvmlInit", "error": "NVML_ERROR_DRIVER_NOT_LOADED", "times": 2}]
    agent = start_agent(tmp_path / "state", wait_ready=False,
                        env=_env(notify_socket, GPU_AGENT_SIM_FAULTS=json.dumps(faults)))
    notify_socket.agent = agent
    try:
        assert agent.request("GET", "/readyz", token=None).status == 503
        assert not notify_socket.with_key("READY")
        _, pid, ready = notify_socket.wait_for("READY")
        assert notify_socket.on_ready == [200], "READY=1 came before /readyz was ready"
        assert pid == agent.proc.pid  # NotifyAccess=main: the main process sends
        assert ready["READY"] == "1" and ready["STATUS"].startswith("ready: 8 GPUs")
        statuses = [m[2]["STATUS"] for m in notify_socket.with_key("STATUS")]
        assert any("NVML not available" in s for s in statuses), statuses
        assert any("reconciling claims" in s for s in statuses), statuses
        # Beats every WATCHDOG_USEC/3 = 0.1 s while the loop and collector are healthy.
        before = len(notify_socket.with_key("WATCHDOG"))
        def five_beats() -> list[tuple[float, int, dict[str, str]]] | None:
            new = notify_socket.with_key("WATCHDOG")[before:]
            return new if len(new) >= 5 else None
        beats = wait_for(five_beats, "5 watchdog beats within a second", 1.0)
        assert all(b[2]["WATCHDOG"] == "1" for b in beats)
        assert agent.stop(signal.SIGTERM) == 0
        stopping = notify_socket.wait_for("STOPPING", timeout=2)
        assert stopping[2]["STOPPING"] == "1"
    finally:
        agent.stop(signal.SIGKILL)


def test_watchdog_stops_when_the_event_loop_stalls(tmp_path: Path,
                                                   notify_socket: NotifySocket) -> None:
    agent = start_agent(tmp_path / "state",
                        env=_env(notify_socket, GPU_AGENT_TEST_STALL_LOOP_AFTER_S="1.0"))
    try:
        ready_at = notify_socket.wait_for("READY")[0]
        # The hook blocks the loop 1 s after READY=1; beats (every 0.1 s) must then stop.
        def silent() -> list[float] | None:
            beats = [m[0] for m in notify_socket.with_key("WATCHDOG")]
            last = beats[-1] if beats else ready_at
            return beats if time.monotonic() - last >= 1.5 else None
        beats = wait_for(silent, "the watchdog to fall silent for 1.5 s", 15, every_s=0.05)
        assert len([t for t in beats if t >= ready_at]) >= 3, "no beats before the stall"
        assert agent.proc.poll() is None  # alive, just stalled: systemd would now kill it
        assert "test hook: the event loop will stall" in agent.log()
    finally:
        agent.stop(signal.SIGKILL)


def test_notify_socket_without_systemd_python_refuses_to_start(tmp_path: Path) -> None:
    # A sitecustomize that hides the systemd package, as on a host without the extra.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['systemd'] = None\n")
    env = {"NOTIFY_SOCKET": str(tmp_path / "nowhere"),
           "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    done = subprocess.run([sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100",
                           "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0"],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 2
    assert "systemd-python is not installed" in done.stderr
    assert "gpu-node-agent[systemd]" in done.stderr
