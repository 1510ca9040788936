"""The ``gpu-agent kubelet-plugin`` process: its flags, its sockets where kubelet looks for
them (stale ones replaced), a clean exit on SIGTERM with both sockets removed, and refusal
of a token file others can read."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.kubeplugin.agent_client import TokenFile
from agent.kubeplugin.errors import TokenFileError
from tests.kubeplugin.conftest import DRIVER, NODE, Agent, write_private


def start_plugin(root: Path, agent: Agent | None, *extra: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The plugin process on ``agent`` (None: no agent; a token file under ``root``)."""
    socket_path = agent.process.socket_path if agent else root / "no-agent.sock"
    token = agent.token_file if agent else root / "plugin.token"
    if agent is None and not token.exists():
        write_private(token, "t\n")
    args = [sys.executable, "-m", "tests.kubeplugin.plugin_main", "kubelet-plugin",
            "--agent-socket", str(socket_path), "--token-file", str(token),
            "--registry-dir", str(root / "reg"), "--plugins-dir", str(root / "plug"),
            "--health-listen", "127.0.0.1:0", "--log-format", "json", *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def stale_socket(path: Path) -> None:
    """A socket file nobody serves, as a killed plugin leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def test_sigterm_stops_the_plugin_cleanly_and_removes_its_sockets(short_dir: Path,
                                                                 agent: Agent) -> None:
    """Started with stale sockets in place and NODE_NAME from the environment, the process
    serves both sockets and its health listener, logs JSON, and on SIGTERM exits 0 with both
    socket files gone."""
    registration = short_dir / "reg" / f"{DRIVER}-reg.sock"
    endpoint = short_dir / "plug" / DRIVER / "dra.sock"
    for path in (registration, endpoint):
        stale_socket(path)
    proc = start_plugin(short_dir, agent, env={"NODE_NAME": NODE})
    try:
        lines: list[dict[str, object]] = []
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(json.loads(raw))
            if lines[-1]["msg"] == "kubelet plugin started":
                break
        started = lines[-1]
        assert started["node"] == NODE and started["driver"] == DRIVER, lines
        assert sum(1 for line in lines if line["msg"] == "removed a stale socket") == 2
        for path in (registration, endpoint):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(str(path))  # served now
            probe.close()
        with urllib.request.urlopen(f"http://{started['health']}/healthz", timeout=5) as reply:
            assert reply.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not registration.exists() and not endpoint.exists()
    finally:
        stop(proc)


@pytest.mark.parametrize(("flags", "message"), [
    (["--node-name", ""], "--node-name (or NODE_NAME) is required"),
    (["--node-name", NODE, "--health-listen", "nowhere"], "expected HOST:PORT"),
    (["--node-name", NODE, "--agent-lost-after", "0"], "--agent-lost-after"),
])
def test_bad_settings_stop_the_start_naming_the_flag(short_dir: Path, flags: list[str],
                                                     message: str) -> None:
    """Settings that cannot work exit 2 with a one-line reason naming the flag."""
    proc = start_plugin(short_dir, None, *flags, env={"NODE_NAME": ""})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and message in out, out


def test_a_token_file_others_can_read_is_refused(short_dir: Path) -> None:
    """A group- or world-readable token file stops the start, naming the file and the fix."""
    token = write_private(short_dir / "plugin.token", "t\n")
    os.chmod(token, 0o640)
    proc = start_plugin(short_dir, None, "--node-name", NODE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out
    assert str(token) in out and "0640" in out and "0600" in out


@pytest.mark.parametrize(("text", "token"), [
    ("secret\n", "secret"),
    ("# the plugin's token\nplugin:secret:claims\n", "secret"),
    ("plugin:secret\n", "secret"),
])
def test_the_token_file_holds_a_bare_token_or_an_agent_line(tmp_path: Path, text: str,
                                                            token: str) -> None:
    """The token is the file's first line, or the token field of a name:token[:scopes] line."""
    assert TokenFile(write_private(tmp_path / "t", text)).token() == token


def test_a_changed_token_file_is_read_again(tmp_path: Path) -> None:
    """A rewritten token file gives the new token on the next call; an emptied one is an
    error rather than an empty token."""
    tokens = TokenFile(write_private(tmp_path / "t", "first\n"))
    assert tokens.token() == "first"
    write_private(tmp_path / "t", "second-token\n")
    assert tokens.token() == "second-token"
    write_private(tmp_path / "t", "# nothing\n")
    with pytest.raises(TokenFileError, match="holds no token"):
        tokens.token()


def test_a_live_plugins_socket_is_not_taken_over(short_dir: Path) -> None:
    """A second plugin for the same driver refuses to start instead of removing the first
    one's sockets."""
    first = start_plugin(short_dir, None, "--node-name", NODE)
    try:
        assert first.stdout is not None
        for raw in first.stdout:
            if json.loads(raw)["msg"] == "kubelet plugin started":
                break
        second = start_plugin(short_dir, None, "--node-name", NODE)
        out, _ = second.communicate(timeout=30)
        assert second.returncode == 2 and "another process is serving on it" in out, out
        assert (short_dir / "reg" / f"{DRIVER}-reg.sock").is_socket()
    finally:
        stop(first)
