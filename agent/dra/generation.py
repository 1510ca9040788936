"""The pool generation: it grows whenever the pool's content changes, and never goes back,
not even across restarts (consumers use only the slices of the highest generation, so a
smaller number after a restart would hide the new slices behind the old ones).

Downgrade: an agent from before the durable envelope cannot read ``pool.json``; it keeps the
file aside and restarts the generation from the clock, which is still above any earlier
value."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from agent.durable import DurableMap

log = logging.getLogger("agent.dra")
_KEY = "pool"


def fingerprint(content: Any) -> str:
    """A stable digest of JSON-able content."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


class PoolGeneration:
    """``<state>/dra/pool.json``: the last generation and the fingerprint it was given to."""

    def __init__(self, path: Path) -> None:
        self._store = DurableMap(path, format="gpu-agent-dra-pool")
        self._lock = asyncio.Lock()
        self.problem = self._store.problem
        record = self._store.get(_KEY)
        valid = (isinstance(record, dict) and isinstance(record.get("generation"), int)
                 and isinstance(record.get("fingerprint"), str))
        if record is not None and not valid:
            self.problem = f"{path}: unusable pool record {record!r}"
        self._generation: int = record["generation"] if valid else 0
        self._fingerprint: str | None = record["fingerprint"] if valid else None
        if self.problem:
            # The old number is unknown: the clock in seconds is above any count of changes
            # this node can have made, so the generation still does not go back.
            self._generation = max(self._generation, int(time.time()))
            log.error("pool generation unreadable", extra={"problem": self.problem,
                                                           "restart_from": self._generation})

    @property
    def generation(self) -> int:
        return self._generation

    async def for_content(self, digest: str) -> int:
        """The generation for content with this fingerprint: unchanged content keeps its
        number, new content gets the next one, written durably (in a thread) before it is
        returned or remembered. :class:`StorageUnavailable` when it cannot be written: a
        number that a restart could hand out again is never returned."""
        async with self._lock:  # concurrent renders of new content take one number
            if digest != self._fingerprint:
                generation = self._generation + 1
                await self._store.set(_KEY, {"generation": generation, "fingerprint": digest,
                                             "changed_at": time.time()})
                self._generation, self._fingerprint = generation, digest
            return self._generation
