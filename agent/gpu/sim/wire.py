"""The simulator's Unix sockets (the driver socket, each MPS control daemon's socket) and the
one message shape on them: a JSON object per line, one request and one reply per connection.

``sun_path`` holds 108 bytes and test paths are longer, so a socket is bound and reached
through ``/proc/self/fd/<n>/<name>`` of a descriptor of its directory (no ``chdir``: the
simulated node is threaded)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The most a request or reply may hold (both are small JSON objects).
MAX_MESSAGE = 1 << 20
_SUN_PATH = 100


@contextlib.contextmanager
def _short(path: Path) -> Iterator[str]:
    """A name for ``path`` that fits ``sun_path``, valid inside the block."""
    text = os.fsencode(path)
    if len(text) < _SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def listen(path: Path, *, backlog: int = 16) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale socket file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as name:
            sock.bind(name)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(path: Path, *, timeout_s: float) -> socket.socket:
    """A connected socket to ``path``; OSError when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        with _short(path) as name:
            sock.connect(name)
    except BaseException:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def receive(sock: socket.socket) -> dict[str, Any]:
    """One message (a line); ValueError on a malformed or oversized one, or on EOF first."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("connection closed before a whole message")
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise ValueError("message too large")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("message is not a JSON object")
    return message


def request(path: Path, message: dict[str, Any], *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one request to the socket at ``path`` and return its reply; OSError when the
    socket is unreachable, ValueError on a malformed reply."""
    with connect(path, timeout_s=timeout_s) as sock:
        send(sock, message)
        return receive(sock)
