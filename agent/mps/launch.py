"""Where an MPS control daemon is started: the one decision that makes daemons outlive the
agent (``docs/sharing.md``).

``nvidia-cuda-mps-control -d`` daemonizes, but a daemonized process stays in its parent's
cgroup: started by the agent, it dies when the runtime stops the agent's container or
systemd stops its unit. :class:`MpsLauncher` is the seam: the agent's MPS code hands it the
argv and environment of one ``-d`` start and gets back once the command exited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LaunchResult:
    """How one ``nvidia-cuda-mps-control -d`` start ended (the daemonizing parent's exit)."""

    returncode: int
    output: str
    """Its standard output and error, truncated (for the error message)."""


class MpsLauncher(Protocol):
    """Runs ``argv`` (an ``nvidia-cuda-mps-control -d`` start) with exactly ``env`` and returns
    how it exited; raises :class:`agent.errors.AgentError` when it cannot run it at all."""

    async def launch(self, argv: Sequence[str], env: Mapping[str, str], *,
                     timeout_s: float) -> LaunchResult: ...

    def describe(self) -> str:
        """Where daemons run, for logs and ``/v1/node`` (e.g. ``mps-host unix:/run/...``)."""
        ...
