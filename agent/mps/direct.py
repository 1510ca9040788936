"""Starting ``nvidia-cuda-mps-control -d`` and ``nvidia-imex`` from this very process
(``DirectLauncher``).

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

from agent.errors import ImexUnavailable, SharingUnavailable
from agent.mps import imex_namespace
from agent.mps.launch import LaunchResult

#: The most characters of a start's output kept for an error message.
MAX_OUTPUT = 4000
TOOL = "nvidia-cuda-mps-control"
IMEX_TOOL = "nvidia-imex"


def _read_output(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read(MAX_OUTPUT + 1).decode(errors="replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "…"


async def _run(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float,
               pass_fds: Collection[int], tool: str, what: str) -> LaunchResult:
    """Run ``argv`` in a session of its own, its output in a temporary file; see
    :meth:`DirectLauncher.launch`."""
    # A temporary file (unlinked at once) instead of a pipe: the daemonized grandchild
    # inherits it and may keep it open for its whole life.
    with tempfile.TemporaryFile(prefix="gpu-agent-launch-") as out:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                pass_fds=tuple(pass_fds))
        except OSError as err:
            raise SharingUnavailable(f"cannot run {argv[0]}: {err.strerror or err}",
                                     tool=tool, reason=f"cannot run: {err}") from err
        try:
            returncode = await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            # Only the starting process and what is still in its group: a daemon that
            # already left for a session of its own is not ours to kill.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise SharingUnavailable(
                f"{what} did not exit within {timeout_s:g} s: {_read_output(out)}",
                tool=tool, reason="timeout") from None
        return LaunchResult(returncode=returncode, output=_read_output(out))


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
        return await _run(argv, env, timeout_s=timeout_s, pass_fds=pass_fds, tool=TOOL,
                          what=f"{argv[0]} -d")

    async def launch_imex(self, imex: str, config: str, hosts: str, *,
                          timeout_s: float) -> LaunchResult:
        """Run ``imex -c config`` in a mount namespace of its own where ``/etc/hosts`` is
        ``hosts`` (:mod:`agent.mps.imex_namespace`), with this process's environment, and
        wait (at most ``timeout_s``) for the starter to exit. ImexUnavailable when the
        namespace cannot be made (it needs root: CAP_SYS_ADMIN) or the binary cannot be run;
        SharingUnavailable when it does not exit in time."""
        done = await _run(imex_namespace.command(imex, config, hosts), os.environ,
                          timeout_s=timeout_s, pass_fds=(), tool=IMEX_TOOL,
                          what=f"{imex} -c {config}")
        if done.returncode == imex_namespace.FAILED and \
                done.output.startswith(imex_namespace.MARKER):
            why = done.output.removeprefix(imex_namespace.MARKER).strip()
            hint = "" if os.geteuid() == 0 else (
                " (making a mount namespace needs root, CAP_SYS_ADMIN: run the agent as "
                "root, or let the MPS host start the daemon with --mps-host-socket)")
            raise ImexUnavailable(f"{why}{hint}", reason="no namespace")
        return done

    def describe(self) -> str:
        """Where daemons run: here, in this process's cgroup."""
        return ("direct: daemons are started by this process and stay in its cgroup; they "
                "die when its container or systemd unit stops (development only)")
