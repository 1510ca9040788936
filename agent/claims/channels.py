"""The seam between claims and compute domains: a claim's IMEX channel is held, made ready and
released through :class:`Channels` (the domain service, ``agent/domains/``), and written into
the claim's CDI spec like its other devices."""

from __future__ import annotations

from typing import Protocol

from agent.claims.checkpoint import ClaimRecord
from agent.ledger.ledger import HoldState

#: The channel a domain's claims share (NVIDIA's default ``Single`` allocation mode).
CHANNEL = 0
CHANNEL_NAME = f"imex-channel-{CHANNEL}"


class Channels(Protocol):
    """What the claims service asks of the compute domains."""

    def reserve(self, uid: str, domain_id: str) -> None:
        """Hold the domain's channel for claim ``uid`` (no await), or raise why not."""
        ...

    def hold(self, uid: str, *, state: HoldState = "prepared") -> None:
        """Put a recorded claim's hold back (start-up)."""
        ...

    async def ready(self, domain_id: str) -> None:
        """Return once this node's IMEX daemon serves the domain, or raise why not."""
        ...

    async def released(self, domain_id: str, *, leave: bool) -> None:
        """A claim of the domain let its channel go (``leave``: it was unprepared)."""
        ...


def channel_specs(record: ClaimRecord) -> list[tuple[str, int]]:
    """The claim's channels for its CDI spec: (device name, channel number)."""
    return [(record.imex.device_name, record.imex.channel)] if record.imex is not None else []
