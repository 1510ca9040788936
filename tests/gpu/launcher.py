"""A test-only :class:`~agent.mps.launch.MpsLauncher`: runs the ``-d`` start as a child
of the test, in its own process group (so a test can kill that group as a runtime would)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from agent.mps.launch import LaunchResult


class SubprocessLauncher:
    """Runs argv with exactly env; records every launch."""

    def __init__(self) -> None:
        self.launched: list[tuple[list[str], dict[str, str]]] = []

    async def launch(self, argv: Sequence[str], env: Mapping[str, str], *,
                     timeout_s: float) -> LaunchResult:
        self.launched.append((list(argv), dict(env)))
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(env), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return LaunchResult(returncode=124, output="timed out")
        return LaunchResult(returncode=proc.returncode or 0, output=out.decode(errors="replace"))

    def describe(self) -> str:
        return "test subprocess"
