"""ResourceClaim reads, each on its own: a bounded number at once, shared fairly among
kubelet's calls, each with a deadline, so one slow or hanging read delays only its own claim.

A plain pool would not do: aiohttp queues requests behind its connection limit, so a call of
2,000 claims whose reads the API server leaves hanging made every other claim of the node
wait behind them (26-33 s, then timeouts). Here:

- at most :data:`READS_AT_ONCE` reads run (the claim client's own connection pool, apart
  from the publisher's), and one kubelet call holds at most :data:`READS_PER_CALL` of them,
  so another call always finds a free slot however a call's reads hang;
- a free slot goes to the call with the fewest reads running (the oldest call first among
  equals), so a call of one claim is not queued behind a call of thousands;
- each read has :data:`READ_TIMEOUT_S`, a per-claim error after it;
- a claim already being read (kubelet's retry of the same call) waits for that read instead
  of queueing a second one, so retries of hanging claims do not grow the queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent.kubeplugin.protocols import ClaimReader

#: Reads running at once (the claim client's connections).
READS_AT_ONCE = 64
#: Reads of one kubelet call running at once.
READS_PER_CALL = READS_AT_ONCE // 2
#: A claim read's deadline: a GET of one object answers in milliseconds on a healthy server.
READ_TIMEOUT_S = 10.0

Json = dict[str, Any]


class ClaimReadTimeout(Exception):
    """The API server did not answer a claim read within its deadline."""


@dataclass
class _Call:
    """One kubelet call's reads: waiting, in order, and how many run."""

    waiting: deque[tuple[tuple[str, str], asyncio.Future[Json]]] = field(default_factory=deque)
    running: int = 0


class ClaimReads:
    """Reads claims through ``reader`` as the module's docstring says."""

    def __init__(self, reader: ClaimReader, *, at_once: int = READS_AT_ONCE,
                 per_call: int = READS_PER_CALL, timeout_s: float = READ_TIMEOUT_S) -> None:
        self._reader = reader
        self._at_once = at_once
        self._per_call = max(1, min(per_call, at_once))
        self.timeout_s = timeout_s
        self._calls: dict[object, _Call] = {}  # in arrival order
        self._reads: dict[tuple[str, str], asyncio.Future[Json]] = {}
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """Reads running now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Reads waiting for a slot."""
        return sum(len(c.waiting) for c in self._calls.values())

    async def read(self, call: object, namespace: str, name: str) -> Json:
        """The ResourceClaim ``namespace/name`` for kubelet's call ``call`` (any object, one
        per call); the reader's error, or :class:`ClaimReadTimeout`."""
        key = (namespace, name)
        read = self._reads.get(key)
        if read is None:
            read = asyncio.get_running_loop().create_future()
            read.add_done_callback(_retrieved)
            self._reads[key] = read
            self._calls.setdefault(call, _Call()).waiting.append((key, read))
            self._start_reads()
        return await asyncio.shield(read)

    def _start_reads(self) -> None:
        while self._running < self._at_once:
            call = self._next_call()
            if call is None:
                return
            entry = self._calls[call]
            key, read = entry.waiting.popleft()
            entry.running += 1
            self._running += 1
            task = asyncio.ensure_future(self._run(call, key, read))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _next_call(self) -> object | None:
        """The call whose read starts next: it has one waiting, is under its share, and runs
        the fewest (the oldest among equals)."""
        best: object | None = None
        fewest = self._per_call
        for call, entry in self._calls.items():
            if entry.waiting and entry.running < fewest:
                best, fewest = call, entry.running
        return best

    async def _run(self, call: object, key: tuple[str, str], read: asyncio.Future[Json]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                obj = await self._reader.get_resource_claim(*key)
        except TimeoutError:
            if not read.done():
                read.set_exception(ClaimReadTimeout(
                    f"the API server did not answer the read within {self.timeout_s:g} s"))
        except asyncio.CancelledError:
            read.cancel()
            raise
        except Exception as err:  # the reader's failure is this claim's
            if not read.done():
                read.set_exception(err)
        else:
            if not read.done():
                read.set_result(obj)
        finally:
            self._reads.pop(key, None)
            entry = self._calls[call]
            entry.running -= 1
            self._running -= 1
            if not entry.running and not entry.waiting:
                del self._calls[call]
            self._start_reads()

    async def close(self) -> None:
        """Cancel the reads still running (the plugin's stop)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))


def _retrieved(read: asyncio.Future[Json]) -> None:
    # A read whose waiters all went (kubelet's call cancelled at stop) still ends: mark its
    # error seen so asyncio does not log it as never retrieved.
    if not read.cancelled():
        read.exception()
