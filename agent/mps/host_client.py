"""Starting MPS control daemons, and the IMEX daemon, through ``gpu-agent mps-host``
(``HostLauncher``).

The host is a process of its own (a DaemonSet of its own, or its own systemd unit), so a
daemon it starts lives in its cgroup and outlives an agent restart, however the runtime
kills the agent. Only the start goes through it; commands and ``quit`` reach an MPS daemon
through its pipe directory as before, and the agent signals its IMEX daemon itself (by pid).
Wire format: ``agent/mps/protocol.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.errors import ImexUnavailable, SharingUnavailable
from agent.mps import protocol
from agent.mps.direct import DirectLauncher
from agent.mps.launch import LaunchResult, MpsLauncher

TOOL = "mps-host"
#: The first pause before connecting again to a host whose listen backlog is full.
_CONNECT_RETRY_S = 0.005


class HostLauncher:
    """Asks the MPS host on ``socket_path`` to run each start."""

    def __init__(self, socket_path: Path, *, connect_timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.connect_timeout_s = connect_timeout_s

    async def launch(self, argv: Sequence[str], env: Mapping[str, str], *,
                     timeout_s: float) -> LaunchResult:
        """Have the host run ``argv`` with ``env``; how the start exited. SharingUnavailable,
        naming the socket, when the host is unreachable, refuses, or cannot run it."""
        reply = await self._exchange(
            {"op": "launch", "argv": list(argv), "env": dict(env), "timeout_s": timeout_s},
            timeout_s=timeout_s + self.connect_timeout_s)
        return self._result(reply)

    def _result(self, reply: dict[str, Any]) -> LaunchResult:
        code = reply.get("returncode")
        output = reply.get("output", "")
        if not isinstance(code, int) or not isinstance(output, str):
            raise self._error("answered a launch without returncode/output")
        return LaunchResult(returncode=code, output=output)

    async def launch_imex(self, imex: str, config: str, hosts: str, *,
                          timeout_s: float) -> LaunchResult:
        """Have the host run ``imex -c config`` with ``hosts`` at the daemon's /etc/hosts;
        how the start exited. ImexUnavailable, naming the socket, when the host is
        unreachable, refuses (no ``--imex``, another binary, a file not below its
        ``--imex-root``), or cannot run it."""
        try:
            reply = await self._exchange(
                {"op": "launch-imex", "imex": imex, "config": config, "hosts": hosts,
                 "timeout_s": timeout_s}, timeout_s=timeout_s + self.connect_timeout_s)
            return self._result(reply)
        except SharingUnavailable as err:
            raise ImexUnavailable(err.detail, reason=f"mps-host: {err.reason}") from err

    async def ping(self) -> dict[str, Any]:
        """The host's answer to ``ping`` (its MPS binary and root); SharingUnavailable when
        it is not there."""
        return await self._exchange({"op": "ping"}, timeout_s=self.connect_timeout_s)

    def describe(self) -> str:
        """Where daemons run: in the MPS host's cgroup."""
        return (f"mps-host unix:{self.socket_path}: daemons run in the MPS host's cgroup and "
                "outlive agent restarts")

    async def _exchange(self, request: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        try:
            line = protocol.encode(request)
        except protocol.ProtocolError as err:
            raise self._error(f"request too large: {err}") from err
        try:
            reply = await asyncio.wait_for(self._round_trip(line), timeout_s)
        except TimeoutError:
            raise self._error(f"no answer within {timeout_s:g} s", reason="timeout") from None
        except (OSError, protocol.ProtocolError) as err:
            raise self._error(f"unreachable: {err}", reason="unreachable") from err
        if reply.get("v") != protocol.VERSION:
            raise self._error(f"speaks protocol version {reply.get('v')!r}, not "
                              f"{protocol.VERSION}", reason="version")
        if reply.get("ok") is not True:
            kind = str(reply.get("error", "failed"))
            field = reply.get("field")
            what = f"{kind}{f' ({field})' if field else ''}: {reply.get('reason', '')}"
            raise self._error(what, reason=what)
        return reply

    async def _round_trip(self, line: bytes) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            await _connect(sock, str(self.socket_path))
            # A busy host answers before it reads and closes: the request may not go out
            # (EPIPE), but the answer is there to read.
            with contextlib.suppress(ConnectionError):
                await loop.sock_sendall(sock, line)
            answer = b""
            while not answer.endswith(b"\n"):
                try:
                    chunk = await loop.sock_recv(sock, protocol.MAX_LINE)
                except ConnectionResetError:
                    break  # closed with our request unread, after what it had to say
                if not chunk:
                    break
                answer += chunk
                if len(answer) > protocol.MAX_LINE:
                    raise protocol.ProtocolError(f"answer over {protocol.MAX_LINE} bytes")
            if not answer.endswith(b"\n"):
                raise protocol.ProtocolError("closed without an answer")
            return protocol.decode(answer)

    def _error(self, what: str, *, reason: str | None = None) -> SharingUnavailable:
        return SharingUnavailable(f"MPS host on {self.socket_path}: {what}", tool=TOOL,
                                  reason=reason or what)


async def _connect(sock: socket.socket, path: str) -> None:
    """Connect the non-blocking ``sock`` to ``path``. A Unix socket's connect never waits in
    the kernel: it fails EAGAIN while the listen backlog is full (a flood of peers), so it
    is tried again, a little later each time, until the caller's deadline."""
    pause = _CONNECT_RETRY_S
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)


def launcher_for(socket_path: Path | None) -> MpsLauncher:
    """The launcher the settings ask for: the MPS host on ``socket_path``
    (``--mps-host-socket``), or, without one, the agent itself (development only)."""
    return HostLauncher(socket_path) if socket_path is not None else DirectLauncher()
