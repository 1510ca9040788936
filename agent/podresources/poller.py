"""Asks kubelet who holds which device once per collection interval, off the scrape path, and
keeps the answer for the metrics collector (which reads it from its own thread: the mapping is
an immutable value replaced whole).

Bounded: each call has a deadline (``timeout_s``), and polls run in their own task, so a
kubelet that fails or hangs never delays a collection or a scrape, only the next poll. The
last good answer is kept for :data:`KEEP_INTERVALS` failed polls (a kubelet restart does not
make every series flap), then dropped, so a series never stays attributed to a pod long after
kubelet stopped saying so."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from agent.gpu.types import Gpu
from agent.podresources.holders import ContainerHolding, Holders, holders_by_device

log = logging.getLogger("agent.podresources")

#: Failed polls after which the last good answer is dropped.
KEEP_INTERVALS = 3


class PodResourcesPoller:
    """``run`` polls until cancelled; ``holders`` is the latest mapping (empty before the
    first answer). ``fetch`` is the client's ``list``; ``gpus`` the inventory's GPUs now."""

    def __init__(self, *, fetch: Callable[[], Awaitable[Sequence[ContainerHolding]]],
                 gpus: Callable[[], Sequence[Gpu]], driver: str, interval_s: float,
                 timeout_s: float = 5.0, close: Callable[[], Awaitable[None]] | None = None,
                 on_error: Callable[[], None] | None = None,
                 on_success: Callable[[float], None] | None = None) -> None:
        self._fetch = fetch
        self._close = close
        self._gpus = gpus
        self._driver = driver
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_error = on_error
        self._on_success = on_success
        self._holders: Holders = {}
        self._failures = 0

    def holders(self) -> Holders:
        """Per device, the containers holding it (the collector's callable)."""
        return self._holders

    async def poll(self) -> bool:
        """One call to kubelet; True when it answered."""
        try:
            # The client's own deadline bounds the call; this one bounds anything else
            # (a connect that never completes) as well.
            holdings = await asyncio.wait_for(self._fetch(), timeout=self.timeout_s)
        except Exception as err:
            self._failures += 1
            if self._on_error is not None:
                self._on_error()
            if self._failures == 1:
                log.warning("pod resources unavailable", extra={"error": str(err) or
                                                                type(err).__name__})
            if self._failures >= KEEP_INTERVALS:
                self._holders = {}
            return False
        if self._failures:
            log.info("pod resources available again", extra={"failed_polls": self._failures})
        self._failures = 0
        self._holders = holders_by_device(holdings, self._gpus(), driver=self._driver)
        if self._on_success is not None:
            self._on_success(time.time())
        return True

    async def run(self) -> None:
        """Poll once per interval until cancelled (the first poll one interval from now:
        the node's start has made one)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def close(self) -> None:
        """Close the client's channel."""
        if self._close is not None:
            await self._close()
