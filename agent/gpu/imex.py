"""NVIDIA's IMEX tools as the guide documents them: ``nvidia-imex -c <config>`` starts the
daemon (``DAEMONIZE=1``: the starter exits once it serves), ``nvidia-imex-ctl -c <config> -q``
prints its state and ``-N -j`` the domain as it sees it; the daemon stops on SIGTERM and
restarts its outgoing connections on SIGUSR1 (at most once per 5 s). The
parsing of what the tools print is pure (:func:`parse_state`, :func:`parse_domain`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ImexUnavailable, SharingUnavailable
from agent.gpu.tools import executable, run_tool, truncated
from agent.mps.launch import ImexLauncher

TOOL = "nvidia-imex"
CTL = "nvidia-imex-ctl"
_POLL_S = 0.05


@dataclass(frozen=True)
class ImexNode:
    """One node of the domain as the local daemon sees it (``nvidia-imex-ctl -N -j``)."""

    index: int
    host: str
    status: str


@dataclass(frozen=True)
class ImexDomainView:
    """The domain as the local daemon sees it: ``UP``, ``DEGRADED`` or ``DOWN``, and its
    nodes."""

    status: str
    nodes: tuple[ImexNode, ...]


def parse_state(output: str) -> str | None:
    """The daemon state ``-q`` printed (its first line: ``READY``, ``WAITING_FOR_PEERS``,
    ...), or None for no output."""
    for line in output.splitlines():
        if line.strip():
            return line.strip()
    return None


def parse_domain(output: str) -> ImexDomainView | None:
    """What ``-N -j`` printed, or None when it is not that JSON shape."""
    try:
        doc = json.loads(output)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        return None
    nodes = []
    for entry in doc["nodes"]:
        if not isinstance(entry, dict):
            return None
        index = entry.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            return None
        nodes.append(ImexNode(index=index, host=str(entry.get("host", "")),
                              status=str(entry.get("status", ""))))
    return ImexDomainView(status=str(doc.get("status", "")), nodes=tuple(nodes))


def command_line(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """A process's argv, or None when there is no such process (or it is a zombie)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None
    return [part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")]


def runs_config(argv: list[str] | None, config: Path) -> bool:
    """Whether ``argv`` is an IMEX daemon started with ``-c <config>`` (pure)."""
    if not argv:
        return False
    return any(flag == "-c" and value == str(config)
               for flag, value in itertools.pairwise(argv))


class ImexControl:
    """The ``nvidia-imex`` and ``nvidia-imex-ctl`` binaries; the daemon is started through
    ``launcher`` (in a mount namespace of its own with the domain's hosts file). Failures to
    start are :class:`ImexUnavailable` carrying the daemon's message."""

    def __init__(self, imex: Path, ctl: Path, launcher: ImexLauncher, *,
                 timeout_s: float = 15.0, proc: Path = Path("/proc")) -> None:
        self.imex = Path(imex)
        self.ctl = Path(ctl)
        self.launcher = launcher
        self.timeout_s = timeout_s
        self._proc = proc

    def available(self) -> bool:
        return executable(self.imex) and executable(self.ctl)

    async def start(self, config: Path, hosts: Path) -> None:
        """Run ``nvidia-imex -c <config>`` with ``hosts`` as its ``/etc/hosts`` (a
        daemonizing start: it returns once the daemon serves, or exits non-zero with why
        not)."""
        for binary in (self.imex, self.ctl):
            if not executable(binary):
                raise ImexUnavailable(f"{binary.name} not found or not executable at {binary}",
                                      reason="missing")
        try:
            done = await self.launcher.launch_imex(str(self.imex), str(config), str(hosts),
                                                   timeout_s=self.timeout_s)
        except SharingUnavailable as err:
            raise ImexUnavailable(err.detail, reason=err.reason) from err
        if done.returncode != 0:
            raise ImexUnavailable(
                f"{TOOL} -c {config} exited {done.returncode}: "
                f"{truncated(done.output) or '(no output)'}", reason="start failed")

    def reconnect(self, pid: int, config: Path) -> bool:
        """SIGUSR1 to the daemon ``pid`` if it still runs with ``config``: it restarts its
        outgoing connections, resolving the node names again. Whether it was sent;
        :class:`ImexUnavailable` when this process may not signal it."""
        if not self.runs(pid, config):
            return False
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            return False
        except PermissionError as err:
            raise ImexUnavailable(f"cannot signal the IMEX daemon (pid {pid}): {err.strerror}",
                                  reason="not permitted") from err
        return True

    async def _ctl(self, config: Path, *args: str) -> tuple[int, str]:
        if not executable(self.ctl):
            return 127, f"{CTL} not found at {self.ctl}"
        try:
            done = await run_tool([str(self.ctl), "-c", str(config), *args], tool=CTL,
                                  timeout_s=self.timeout_s)
        except SharingUnavailable as err:
            return 1, err.detail
        return done.returncode, done.output

    async def state(self, config: Path) -> str | None:
        """The daemon's state (``-q``), or None when no daemon answers."""
        code, out = await self._ctl(config, "-q")
        return parse_state(out) if code == 0 else None

    async def domain(self, config: Path) -> ImexDomainView | None:
        """The domain as the daemon sees it (``-N -j``), or None when it does not answer."""
        code, out = await self._ctl(config, "-N", "-j")
        return parse_domain(out) if code == 0 else None

    def find(self, config: Path) -> int | None:
        """The pid of the daemon running with ``config``, if any (a walk of ``/proc``)."""
        try:
            entries = list(self._proc.iterdir())
        except OSError:
            return None
        for entry in entries:
            if entry.name.isdigit() and runs_config(command_line(int(entry.name), self._proc),
                                                    config):
                return int(entry.name)
        return None

    def runs(self, pid: int, config: Path) -> bool:
        """Whether ``pid`` is still the daemon of ``config``."""
        return runs_config(command_line(pid, self._proc), config)

    async def stop(self, pid: int, config: Path, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the daemon, wait (bounded) for it to go, SIGKILL it if it stays."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.runs(pid, config):
                _reap(pid)
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not self.runs(pid, config):
                    _reap(pid)
                    return
                await asyncio.sleep(_POLL_S)


def _reap(pid: int) -> None:
    """Collect the daemon's exit status where it became this process's child (an agent
    that is PID 1 of its container inherits the orphaned daemons): no zombie is left."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
