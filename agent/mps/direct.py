"""Starting ``nvidia-cuda-mps-control -d`` from this very process (``DirectLauncher``).

The agent uses it without ``--mps-host-socket`` (development, tests), and ``gpu-agent
mps-host`` uses it for every launch it accepts. The start runs in a session of its own, so a
signal to the caller's process group (a terminal's Ctrl-C, a harness killing the group)
misses the daemon; but the daemon stays in the caller's cgroup, so it dies when the runtime
stops the caller's container or systemd stops its unit (``docs/sharing.md``, "Where daemons
run").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from collections.abc import Collection, Mapping, Sequence
from typing import IO

from agent.errors import SharingUnavailable
from agent.mps.launch import LaunchResult

#: The most characters of a start's output kept for an error message.
MAX_OUTPUT = 4000
TOOL = "nvidia-cuda-mps-control"


def _read_output(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read(MAX_OUTPUT + 1).decode(errors="replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "…"


class DirectLauncher:
    """Runs each start as a child of this process, with exactly the environment given."""

    async def launch(self, argv: Sequence[str], env: Mapping[str, str], *,
                     timeout_s: float, pass_fds: Collection[int] = ()) -> LaunchResult:
        """Run ``argv`` with ``env`` (and the descriptors ``pass_fds``) and wait (at most
        ``timeout_s``) for it to exit; its output goes to a temporary file rather than a
        pipe, so a daemon that keeps the inherited descriptors open cannot hold the launch
        up. Raises SharingUnavailable when the binary cannot be run or does not exit in time
        (then its process group is killed)."""
        if not argv:
            raise SharingUnavailable("MPS launch: empty command", tool=TOOL,
                                     reason="empty command")
        # A temporary file (unlinked at once) instead of a pipe: the daemonized grandchild
        # inherits it and may keep it open for its whole life.
        with tempfile.TemporaryFile(prefix="gpu-agent-mps-") as out:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    pass_fds=tuple(pass_fds))
            except OSError as err:
                raise SharingUnavailable(f"cannot run {argv[0]}: {err.strerror or err}",
                                         tool=TOOL, reason=f"cannot run: {err}") from err
            try:
                returncode = await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                # Only the starting process and what is still in its group: a daemon that
                # already left for a session of its own is not ours to kill.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise SharingUnavailable(
                    f"{argv[0]} -d did not exit within {timeout_s:g} s: {_read_output(out)}",
                    tool=TOOL, reason="timeout") from None
            return LaunchResult(returncode=returncode, output=_read_output(out))

    def describe(self) -> str:
        """Where daemons run: here, in this process's cgroup."""
        return ("direct: daemons are started by this process and stay in its cgroup; they "
                "die when its container or systemd unit stops (development only)")
