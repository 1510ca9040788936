"""The claims' MPS control daemons (one per MPS config), supervised: adopted at start-up
while they still answer, checked every few seconds, and a daemon that stopped answering
reported (event, its ``state`` failed, durably). The claim keeps its holds until it is
unprepared: nothing else gets the GPU before its compute mode is reset."""

from __future__ import annotations

import asyncio
import time

from agent.claims.checkpoint import ClaimCheckpoint, ClaimRecord, MpsDaemonRecord
from agent.claims.locks import ClaimLocks
from agent.claims.records import claim_details
from agent.claims.sharing_runtime import SharingRuntime
from agent.events import EventLog, Severity


class DaemonSupervisor:
    def __init__(self, *, checkpoint: ClaimCheckpoint, sharing: SharingRuntime,
                 locks: ClaimLocks, events: EventLog) -> None:
        self._checkpoint = checkpoint
        self._sharing = sharing
        self._locks = locks
        self._events = events

    async def adopt(self, record: ClaimRecord) -> None:
        """At start-up: each of a prepared claim's daemons that still answers is adopted as it
        runs (its clients keep their contexts); one that does not is reported failed."""
        for daemon in record.daemons():
            if await self._sharing.alive(daemon):
                if daemon.state != "running":
                    daemon.state, daemon.reason = "running", None
                self._events.append("claim.mps_adopted", f"claim {record.uid}: MPS control "
                                    f"daemon at {daemon.root} still runs; adopted",
                                    details=claim_details(record))
            elif daemon.state != "failed":
                self._failed(record, daemon, "its MPS control daemon was not running when "
                             "the agent started")

    def _failed(self, record: ClaimRecord, daemon: MpsDaemonRecord, reason: str) -> None:
        daemon.state, daemon.reason = "failed", reason
        record.updated_at = time.time()
        self._events.append("claim.mps_failed", f"claim {record.uid}: {reason} "
                            f"({daemon.root}); its pods' CUDA clients have lost MPS; "
                            "unprepare the claim to free its GPUs", severity=Severity.ERROR,
                            details=claim_details(record))

    async def check(self) -> int:
        """Report every daemon of a prepared claim that stopped answering; how many."""
        dead = 0
        running = [(r, d) for r in self._checkpoint.data.claims.values()
                   if r.state == "prepare_completed" for d in r.daemons()
                   if d.state == "running"]
        # All at once: each check is a short nvidia-cuda-mps-control run.
        answers = await asyncio.gather(*(self._sharing.alive(d) for _, d in running))
        for (record, daemon), alive in zip(running, answers, strict=True):
            if alive:
                continue
            async with self._locks.hold(record.uid):
                if self._checkpoint.data.claims.get(record.uid) is not record \
                        or record.state != "prepare_completed" \
                        or not any(d is daemon for d in record.daemons()) \
                        or daemon.state != "running":
                    continue  # unprepared (or re-checked) meanwhile
                if await self._sharing.alive(daemon):
                    continue
                self._failed(record, daemon, "its MPS control daemon stopped answering")
                await self._checkpoint.commit()
                dead += 1
        return dead
