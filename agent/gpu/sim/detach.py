"""The simulated tools' daemons (MPS control, IMEX) forked off as the real ones are: a session
of their own, ``/`` as working directory, standard streams on ``/dev/null``; the starter waits
for the daemon's one report on a pipe (``ok`` once it serves, else why not) before it exits."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import NoReturn


def detach(serve: Callable[[int], NoReturn], timeout_s: float) -> str:
    """Fork ``serve(report_fd)`` off as a daemon; what it wrote to ``report_fd`` within
    ``timeout_s`` (``ok`` once it serves, else why not; empty when it said nothing)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # first child: a new session, then the daemon itself as its child
        os.close(read_end)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.chdir("/")
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        serve(write_end)
    os.close(write_end)
    os.waitpid(child, 0)
    text = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(read_end, 4096) if ready else b""
        if not chunk:
            break
        text += chunk
    os.close(read_end)
    return text.decode(errors="replace")
