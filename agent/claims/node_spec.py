"""The node-wide CDI spec (every device by index and UUID), rewritten from a fresh inventory
whenever a GPU's instances change: a burst of changes is one rewrite, by one writer, in the
node's background task :meth:`NodeSpec.run`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agent.claims.cdi_writer import CdiWriter
from agent.gpu.inventory import GpuInventory

log = logging.getLogger("agent.claims")


class NodeSpec:
    def __init__(self, *, inventory: GpuInventory, cdi: CdiWriter,
                 after: Callable[[], Awaitable[None]]) -> None:
        self._inventory = inventory
        self._cdi = cdi
        #: What else follows a geometry change, on the inventory just refreshed.
        self._after = after
        self._lock = asyncio.Lock()
        self._stale = asyncio.Event()

    async def refresh(self) -> None:
        """Rewrite the spec from a fresh inventory now (one writer at a time). A write under
        way when the node stops is finished, not abandoned in its thread: nothing writes in
        the CDI directory once the node has stopped."""
        async with self._lock:
            gpus = await self._inventory.refresh()
            write = asyncio.ensure_future(asyncio.to_thread(self._cdi.write_node, gpus))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await write
                raise

    def schedule(self) -> None:
        """Rewrite the spec soon (a GPU's instances changed)."""
        self._stale.set()

    async def run(self) -> None:
        """Rewrite the spec each time it went stale (a task of the node)."""
        while True:
            await self._stale.wait()
            self._stale.clear()
            try:
                await self.refresh()
                await self._after()
            except Exception as err:  # derived state: log, and the next change retries
                log.warning("node CDI spec refresh failed", extra={"error": str(err)})
