"""``gpu-agent mps-host`` against hostile local peers, as a real process: a user racing
symlink swaps under the MPS root against daemon starts, a flood of idle connections, and
requests it cannot parse or resolve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import SharingUnavailable
from agent.gpu.sim.node import SimulatedNode
from agent.mps.host_client import HostLauncher

from .processes import HostProcess, daemon_dirs, mps_env, start_host, wait_for

#: Swaps the named directory under the root for a symlink to its twin outside the root and
#: back until the stop file appears (then it is back in place); "<stop>.running" says it is
#: at it. Each state is held a moment (symlink 1 ms, directory 2 ms) so that some checks see
#: the directory and some later lookups the link; the pacing is the adversary's, no test
#: waits on it.
SWAPPER = '''\
import os, sys, time
root, outside, stop, name = sys.argv[1:]
real = os.path.join(root, name)
hidden = real + ".swapped"
open(stop + ".running", "w").close()
while not os.path.exists(stop):
    try:
        os.rename(real, hidden)
    except OSError:
        continue
    try:
        os.symlink(os.path.join(outside, name), real)
        time.sleep(0.001)
        os.unlink(real)
    except OSError:
        pass
    try:
        os.rename(hidden, real)
    except OSError:
        pass
    time.sleep(0.002)
'''
ROUNDS = 16


@pytest.fixture
def simulated(tmp_path: Path) -> Iterator[SimulatedNode]:
    """A simulated node: its nvidia-cuda-mps-control daemons register with its driver (so
    the test knows every daemon that started), write their pid file and socket in the pipe
    directory and control.log in the log directory."""
    node = SimulatedNode("l40s", tmp_path / "state", tmp_path / "proc")
    node.nvml.nvmlInit()
    yield node
    for daemon in node.describe()["mps_daemons"]:
        _kill(int(daemon["pid"]))
    node.close()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _files_below(top: Path) -> list[str]:
    """Everything below ``top`` that is not a directory (files, sockets, links)."""
    return sorted(str(Path(d, f)) for d, _, files in os.walk(top) for f in files)


def _inode(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


@pytest.mark.parametrize("private_shm", [False, True], ids=["plain", "private-shm"])
def test_symlink_swaps_racing_daemon_starts_never_lead_outside_the_root(
        tmp_path: Path, simulated: SimulatedNode, private_shm: bool) -> None:
    """A local user swaps the daemon's directory, or its pipe, log or shm directory, for a
    symlink to its twin outside the MPS root and back, again and again, while the host starts
    real (simulated) daemons there: a start is refused or runs with its own directories, as
    the daemon itself sees them; nothing is ever written outside the root, and with
    --private-shm no daemon gets a directory outside the root at /dev/shm."""
    node = simulated
    binary = node.tools_dir / "nvidia-cuda-mps-control"
    mps_root = tmp_path / "mps"
    mps_root.mkdir()
    outside = tmp_path / "outside"
    host = start_host(tmp_path, mps_root=mps_root, mps_control=binary,
                      flags=("--private-shm",) if private_shm else ())
    started = refused = 0
    shm_outside: list[str] = []
    elsewhere: list[str] = []
    try:
        for n in range(ROUNDS):
            name = f"race{n:02d}"
            root = daemon_dirs(mps_root, name)
            decoy = daemon_dirs(outside, name)
            decoys = {_inode(decoy / sub) for sub in ("", "pipe", "log", "shm")}
            own = {sub: _inode(root / sub) for sub in ("pipe", "log", "shm")}
            stop = tmp_path / f"stop-{name}"
            swapper = subprocess.Popen(
                [sys.executable, "-c", SWAPPER, str(mps_root), str(outside), str(stop),
                 f"{name}{('', '/pipe', '/log', '/shm')[n % 4]}"])
            try:
                wait_for(Path(f"{stop}.running").exists, 30, "the swapper to start")
                try:
                    asyncio.run(HostLauncher(host.socket).launch(
                        [str(binary), "-d"], mps_env(root), timeout_s=30))
                    started += 1
                except SharingUnavailable:
                    refused += 1
            finally:
                stop.touch()
                swapper.wait(30)
            for daemon in node.describe()["mps_daemons"]:
                pid = int(daemon["pid"])
                # What the daemon's own paths are, in its own mount namespace.
                seen = {"pipe": _inode(f"/proc/{pid}/root{daemon['pipe_directory']}"),
                        "log": _inode(f"/proc/{pid}/root{daemon['log_directory']}")}
                elsewhere += [f"{name}: daemon {pid}'s {sub}" for sub in seen
                              if seen[sub] != own[sub]]
                if private_shm:
                    with_shm = _inode(f"/proc/{pid}/root/dev/shm")
                    if with_shm in decoys:
                        shm_outside.append(f"{name}: daemon {pid}")
                    elif with_shm != own["shm"]:
                        shm_outside.append(f"{name}: daemon {pid} has another /dev/shm")
                _kill(pid)
    finally:
        host.stop()
    written = _files_below(outside)
    assert not written, f"written outside the root ({started} started, {refused} " \
                        f"refused): {written}"
    assert not shm_outside, f"/dev/shm outside the root: {shm_outside}"
    assert not elsewhere, f"directories other than the daemon's own: {elsewhere}"
    assert started > 0, f"no start got through the race ({refused} refused)"


def test_a_ping_is_answered_beside_a_thousand_idle_peers(host: HostProcess) -> None:
    """1,000 connections that never send a request do not hold a ping up: peers are served
    concurrently, the oldest idle one is dropped (answered ``busy``) when the connection cap
    is full, and each idle one still open at its idle timeout is answered ``bad-request``."""
    with contextlib.ExitStack() as stack:
        idle = []
        for _ in range(1000):
            conn = stack.enter_context(socket.socket(socket.AF_UNIX))
            conn.connect(str(host.socket))  # blocking: waits while the listen backlog is full
            conn.settimeout(60)
            idle.append(conn)
        # Generous: the bound only tells "answered while the peers are there" from "after
        # them" (308 s when they were served one at a time).
        reply = asyncio.run(HostLauncher(host.socket, connect_timeout_s=60).ping())
        assert reply["ok"] is True
        answers = {json.loads(_line(conn))["error"] for conn in idle}
        assert answers <= {"busy", "bad-request"}, answers
    assert asyncio.run(HostLauncher(host.socket).ping())["ok"] is True


def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_over_the_cap_of_working_connections_a_peer_is_answered_busy(
        tmp_path: Path, mps_root: Path) -> None:
    """With every connection of the cap (--max-connections) holding a launch in progress, a
    new peer is answered ``busy`` at once and closed; once a launch ends, peers are served
    again."""
    hanging = tmp_path / "hanging-mps-control"
    hanging.write_text('#!/bin/sh\necho $$ > "$CUDA_MPS_PIPE_DIRECTORY/started"\n'
                       "exec sleep 120\n")
    hanging.chmod(0o755)
    host = start_host(tmp_path, mps_root=mps_root, mps_control=hanging,
                      flags=("--max-connections", "2"))
    roots = [daemon_dirs(mps_root, f"busy{n}") for n in range(2)]

    async def scenario() -> None:
        launches = [asyncio.ensure_future(HostLauncher(host.socket).launch(
            [str(hanging), "-d"], mps_env(root), timeout_s=100)) for root in roots]
        pids = []
        for root in roots:
            started = root / "pipe" / "started"
            await asyncio.to_thread(wait_for, lambda s=started: s.exists() and s.read_text(),
                                    30, f"{started}")
            pids.append(int(started.read_text()))
        with pytest.raises(SharingUnavailable) as busy:
            await HostLauncher(host.socket).ping()
        assert busy.value.reason.startswith("busy:"), busy.value.reason
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        results = await asyncio.gather(*launches)
        assert [r.returncode for r in results] == [-signal.SIGKILL] * 2
        assert (await HostLauncher(host.socket).ping())["ok"] is True

    try:
        asyncio.run(scenario())
    finally:
        host.stop()


def _launch_line(*, pipe: str = "@ROOT@/a/pipe", log: str = "@ROOT@/a/log") -> bytes:
    """A launch request, the path strings as JSON text (escapes kept)."""
    return (f'{{"v": 1, "op": "launch", "argv": ["@BIN@", "-d"], "env": '
            f'{{"CUDA_MPS_PIPE_DIRECTORY": "{pipe}", "CUDA_MPS_LOG_DIRECTORY": "{log}"}}}}\n'
            ).encode()


@pytest.mark.parametrize(("payload", "field"), [
    (b"[" * (64 * 1024 - 1) + b"\n", None),
    (b"{\"a\": " * 10000 + b"\n", None),
    (b'{"v": 1, "op": "ping", "n": ' + b"1" * 5000 + b"}\n", None),
    (_launch_line(pipe="@ROOT@/a/\\ud800"), "env.CUDA_MPS_PIPE_DIRECTORY"),
    (_launch_line(log="@ROOT@/\\udcff"), "env.CUDA_MPS_LOG_DIRECTORY"),
    (_launch_line(log="@ROOT@/a/" + "x" * 300), "env.CUDA_MPS_LOG_DIRECTORY"),
], ids=["deep-list", "deep-object", "huge-int", "unencodable-pipe", "unencodable-log",
        "name-too-long"])
def test_what_the_host_cannot_parse_or_resolve_is_a_bad_request(
        host: HostProcess, mps_root: Path, mps_control: Path, payload: bytes,
        field: str | None) -> None:
    """Nesting past the parser's depth, an integer past its digit limit, and a path that is
    no file name at all (a lone surrogate, a component over 255 bytes) are answered
    ``bad-request`` (naming the field),
    never a dropped connection; nothing starts and the host keeps serving."""
    daemon_dirs(mps_root, "a")
    payload = payload.replace(b"@BIN@", str(mps_control).encode()) \
        .replace(b"@ROOT@", str(mps_root).encode())
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(30)
        conn.connect(str(host.socket))
        conn.sendall(payload)
        answer = _line(conn)
    assert answer, "closed without an answer"
    reply = json.loads(answer)
    assert (reply["ok"], reply["error"], reply.get("field")) == (False, "bad-request", field)
    assert not list(mps_root.glob("*/pipe/nvidia-cuda-mps-control.pid"))
    assert "Traceback" not in host.logs()
    assert asyncio.run(HostLauncher(host.socket).ping())["ok"] is True
