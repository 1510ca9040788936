"""Running the driver's command-line tools (``nvidia-smi``, ``nvidia-cuda-mps-control``) as
asyncio subprocesses with a deadline: what NVML cannot do (time slice, MPS) goes through them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SharingUnavailable

#: How much of a tool's output an error message carries.
OUTPUT_LIMIT = 2000


@dataclass(frozen=True)
class ToolRun:
    """How one run of a tool ended: exit status and its output (stdout and stderr)."""

    returncode: int
    output: str


def truncated(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """``text`` stripped, cut to ``limit`` characters (an error detail stays readable)."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def executable(path: Path) -> bool:
    """Whether ``path`` is a file this process may execute."""
    return path.is_file() and os.access(path, os.X_OK)


async def run_tool(argv: Sequence[str], *, tool: str, timeout_s: float,
                   env: Mapping[str, str] | None = None, stdin: str | None = None,
                   gpu: str | None = None) -> ToolRun:
    """Run ``argv`` (feeding ``stdin``), wait at most ``timeout_s``; a tool that cannot start
    or outlives its deadline (killed then) is :class:`SharingUnavailable`. A non-zero exit
    is returned, not raised: callers word the error."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None
            else asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=None if env is None else dict(env),
            start_new_session=True)
    except OSError as err:
        raise SharingUnavailable(f"{tool} cannot run: {err.strerror or err}", tool=tool,
                                 reason="not runnable", gpu=gpu) from err
    try:
        out, _ = await asyncio.wait_for(
            proc.communicate(None if stdin is None else stdin.encode()), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SharingUnavailable(f"{tool} did not finish within {timeout_s:g} s (killed)",
                                 tool=tool, reason="timed out", gpu=gpu) from None
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    return ToolRun(returncode=proc.returncode or 0,
                   output=out.decode(errors="replace") if out else "")
