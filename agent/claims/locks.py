"""One lock per claim UID, so a retry waits for the first attempt; an entry lives only while
a call holds or waits on it, so the map stays bounded by the claims in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ClaimLocks:
    def __init__(self) -> None:
        # Per UID: the lock and how many calls hold or wait on it.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        """How many claims have a call holding or waiting on their lock."""
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, uid: str) -> AsyncIterator[None]:
        """Hold the claim's lock; its entry goes on every path once nobody needs it."""
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users > 1:
                self._locks[uid] = (lock, users - 1)
            else:
                del self._locks[uid]
