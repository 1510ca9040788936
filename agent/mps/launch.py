"""Where an MPS control daemon is started: the one decision that makes daemons outlive the
agent (``docs/sharing.md``).

``nvidia-cuda-mps-control -d`` daemonizes, but a daemonized process stays in its parent's
cgroup: started by the agent, it dies when the runtime stops the agent's container or
systemd stops its unit. :class:`MpsLauncher` is the seam: the agent's MPS code hands it the
argv and environment of one ``-d`` start and gets back once the command exited.
:class:`ImexLauncher` is the same seam for the IMEX daemon of a compute domain.
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


class ImexLauncher(Protocol):
    """Starts an IMEX daemon in a mount namespace of its own whose ``/etc/hosts`` is the
    domain's hosts file (``docs/compute-domains.md``, "The node side")."""

    async def launch_imex(self, imex: str, config: str, hosts: str, *,
                          timeout_s: float) -> LaunchResult:
        """Run ``imex -c config`` (a ``DAEMONIZE=1`` start: returns when the starter exited)
        in a mount namespace of its own where ``/etc/hosts`` is the file ``hosts``
        (bind-mounted); :class:`agent.errors.AgentError` (``SharingUnavailable`` or
        ``ImexUnavailable``) when it cannot run it at all."""
        ...

    def describe(self) -> str:
        """Where daemons run, for logs and ``/v1/node``."""
        ...
