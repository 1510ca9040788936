"""MPS control daemons as NVIDIA documents them: ``nvidia-cuda-mps-control -d`` started
through an :class:`~agent.mps.launch.MpsLauncher`, commands sent to
``nvidia-cuda-mps-control`` on its standard input with ``CUDA_MPS_PIPE_DIRECTORY`` set, and
the MPS processes NVML reports (``nvmlDeviceGetMPSComputeRunningProcesses_v3``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import SharingUnavailable
from agent.gpu.session import NvmlSession
from agent.gpu.tools import executable, run_tool, truncated
from agent.mps.launch import MpsLauncher

TOOL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_POLL_S = 0.05


@dataclass(frozen=True)
class MpsDaemonSpec:
    """One control daemon: its directory (``pipe``, ``log``, ``shm`` under it), the devices
    it serves (``CUDA_VISIBLE_DEVICES``), and the defaults its servers get."""

    root: Path
    devices: tuple[str, ...]
    """GPU or MIG UUIDs, in order (clients see them as ordinals 0..n-1)."""
    active_thread_percentage: int | None = None
    pinned_limits_mib: Mapping[str, int] = field(default_factory=dict)
    """Device UUID -> MiB, sent as ``set_default_device_pinned_mem_limit <uuid> <N>M``."""

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        return self.root / "shm"


@dataclass(frozen=True)
class ProcessUse:
    """A process on a device as NVML reports it, with the device memory it uses."""

    pid: int
    used_mib: int


def _pipe(root: Path) -> Path:
    return Path(root) / "pipe"


class MpsControl:
    """The ``nvidia-cuda-mps-control`` binary: starts, configures, queries and stops daemons.
    Every failure is :class:`SharingUnavailable` with the tool's output in the detail."""

    def __init__(self, binary: Path, launcher: MpsLauncher, *, timeout_s: float = 15.0) -> None:
        self.binary = Path(binary)
        self.launcher = launcher
        self.timeout_s = timeout_s

    def available(self) -> bool:
        """Whether the binary exists and is executable."""
        return executable(self.binary)

    def _env(self, root: Path, devices: tuple[str, ...] | None = None) -> dict[str, str]:
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(_pipe(root)),
               "CUDA_MPS_LOG_DIRECTORY": str(Path(root) / "log"),
               "PATH": os.environ.get("PATH") or DEFAULT_PATH}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        return env

    def _missing(self) -> SharingUnavailable:
        return SharingUnavailable(f"{TOOL} not found or not executable at {self.binary}",
                                  tool=TOOL, reason="missing")

    async def _client(self, root: Path, line: str) -> tuple[int, str]:
        if not self.available():
            raise self._missing()
        done = await run_tool([str(self.binary)], tool=TOOL, timeout_s=self.timeout_s,
                              env=self._env(root), stdin=line + "\n")
        return done.returncode, done.output

    async def command(self, root: Path, line: str) -> str:
        """Send a control command (or several, one per line, in one client run) to the daemon
        of ``root``; its reply (stripped). :class:`SharingUnavailable` when no daemon answers
        or a command fails."""
        code, out = await self._client(root, line)
        if code != 0:
            raise SharingUnavailable(
                f"{TOOL} `{line}` (pipe directory {_pipe(root)}) exited {code}: "
                f"{truncated(out) or '(no output)'}", tool=TOOL, reason=f"exit status {code}")
        return out.strip()

    async def alive(self, root: Path) -> bool:
        """Whether a daemon answers ``get_server_list`` on ``root``'s pipe directory."""
        if not _pipe(root).is_dir():
            return False
        try:
            code, _ = await self._client(root, "get_server_list")
        except SharingUnavailable:
            return False
        return code == 0

    async def servers(self, root: Path) -> list[int]:
        """The daemon's MPS server pids (``get_server_list``)."""
        return _pids(await self.command(root, "get_server_list"))

    async def clients(self, root: Path, server: int) -> list[int]:
        """The client pids of one server (``get_client_list <pid>``)."""
        return _pids(await self.command(root, f"get_client_list {int(server)}"))

    async def start(self, spec: MpsDaemonSpec) -> None:
        """Start (or, if one already answers on the pipe directory, re-configure) the daemon
        of ``spec`` and apply its defaults, read back; on failure what this call started is
        stopped and :class:`SharingUnavailable` raised."""
        if not self.available():
            raise self._missing()
        # Asked before the directories are made: a pipe directory that did not exist has no
        # daemon, and answering that costs no client run.
        if await self.alive(spec.root):
            await self._configure(spec)
            return
        for directory in (spec.root, spec.pipe, spec.log, spec.shm):
            await asyncio.to_thread(directory.mkdir, mode=0o755, parents=True, exist_ok=True)
        try:
            result = await self.launcher.launch([str(self.binary), "-d"],
                                                self._env(spec.root, spec.devices),
                                                timeout_s=self.timeout_s)
            if result.returncode != 0:
                raise SharingUnavailable(
                    f"{TOOL} -d (pipe directory {spec.pipe}) exited {result.returncode}: "
                    f"{truncated(result.output) or '(no output)'}", tool=TOOL,
                    reason=f"exit status {result.returncode}",
                    gpu=spec.devices[0] if spec.devices else None)
            await self._wait_started(spec)
            await self._configure(spec)
        except BaseException:
            await asyncio.shield(self._stop_quietly(spec.root))
            raise

    async def _wait_started(self, spec: MpsDaemonSpec) -> None:
        deadline = time.monotonic() + self.timeout_s
        pid_file = spec.pipe / PID_FILE
        while True:
            if pid_file.exists() and await self.alive(spec.root):
                return
            if time.monotonic() >= deadline:
                raise SharingUnavailable(
                    f"{TOOL} -d exited 0 but no daemon answered on {spec.pipe} within "
                    f"{self.timeout_s:g} s (pid file "
                    f"{'present' if pid_file.exists() else 'absent'})",
                    tool=TOOL, reason="not started")
            await asyncio.sleep(_POLL_S)

    async def _configure(self, spec: MpsDaemonSpec) -> None:
        # Two client runs whatever the number of devices: every set, then every get read
        # back (a get answers one line each; what a set prints is not relied on).
        sets: list[str] = []
        expected: list[tuple[str, int, str | None]] = []  # (get, value, device)
        if spec.active_thread_percentage is not None:
            pct = int(spec.active_thread_percentage)
            sets.append(f"set_default_active_thread_percentage {pct}")
            expected.append(("get_default_active_thread_percentage", pct, None))
        for device, mib in spec.pinned_limits_mib.items():
            sets.append(f"set_default_device_pinned_mem_limit {device} {int(mib)}M")
            expected.append((f"get_default_device_pinned_mem_limit {device}", int(mib), device))
        if not sets:
            return
        await self.command(spec.root, "\n".join(sets))
        replies = (await self.command(spec.root, "\n".join(g for g, _, _ in expected)))
        lines = [line for line in replies.splitlines() if line.strip()]
        if len(lines) != len(expected):
            raise SharingUnavailable(
                f"{TOOL}: {len(expected)} settings read back as {len(lines)} line(s): "
                f"{truncated(replies)!r}", tool=TOOL, reason="not applied")
        for (get, value, on), got in zip(expected, lines, strict=True):
            read = _mib(got) if on is not None else _number(got)
            if read != value:
                what = (f"pinned memory limit of {on}" if on is not None
                        else "default active thread percentage")
                raise SharingUnavailable(
                    f"{TOOL}: {what} reads {got!r} after setting {value}"
                    f"{'M' if on is not None else ''} (`{get}`)", tool=TOOL,
                    reason="not applied", gpu=on)

    async def stop(self, root: Path) -> None:
        """``quit`` the daemon of ``root``, wait (bounded) for its pid file to go, remove
        ``root``. Without a live daemon only ``root`` is removed; absent, nothing happens."""
        root = Path(root)
        if not root.exists():
            return
        if await self.alive(root):
            await self.command(root, "quit")
            pid_file = _pipe(root) / PID_FILE
            deadline = time.monotonic() + self.timeout_s
            while pid_file.exists():
                if time.monotonic() >= deadline:
                    raise SharingUnavailable(
                        f"{TOOL} quit: the daemon on {_pipe(root)} still runs after "
                        f"{self.timeout_s:g} s", tool=TOOL, reason="did not stop")
                await asyncio.sleep(_POLL_S)
        await asyncio.to_thread(shutil.rmtree, root, ignore_errors=True)

    async def _stop_quietly(self, root: Path) -> None:
        with contextlib.suppress(SharingUnavailable):
            await self.stop(root)


def _pids(reply: str) -> list[int]:
    return [int(word) for word in reply.split() if word.isdigit()]


def _first_word(reply: str) -> str:
    words = reply.split(maxsplit=1)
    return words[0] if words else ""


def _number(reply: str) -> float | None:
    try:
        return float(_first_word(reply))
    except ValueError:
        return None


def _mib(reply: str) -> int | None:
    """``10240M`` or ``10G`` (as the daemon prints a limit) in MiB."""
    word = _first_word(reply)
    scale = {"M": 1, "G": 1024}.get(word[-1:].upper())
    if scale is None or not word[:-1].isdigit():
        return None
    return int(word[:-1]) * scale


def mps_processes(session: NvmlSession, uuid: str) -> list[ProcessUse]:
    """The MPS client processes on a GPU or MIG device, with their memory, as NVML reports
    them (``nvmlDeviceGetMPSComputeRunningProcesses_v3``; NVML worker thread: call through
    ``session.read``)."""
    handle: Any = session.call("nvmlDeviceGetHandleByUUID", uuid, gpu=uuid)
    found = []
    for proc in session.call("nvmlDeviceGetMPSComputeRunningProcesses_v3", handle, gpu=uuid):
        used = proc.usedGpuMemory
        found.append(ProcessUse(pid=int(proc.pid),
                                used_mib=int(used) // 2**20 if used is not None else 0))
    return found
