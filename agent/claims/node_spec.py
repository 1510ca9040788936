"""The node-wide CDI spec (every device by index and UUID), rewritten whenever a GPU's
instances change, from a fresh read of the GPUs that changed: a burst of changes is one
rewrite, by one writer, in the node's background task :meth:`NodeSpec.run`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

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
        self._changed: set[str] = set()

    async def refresh(self, only: Collection[str] = ()) -> None:
        """Rewrite the spec now from a fresh read of every GPU, or of the GPUs ``only`` names
        (one writer at a time). A write under way when the node stops is finished, not
        abandoned in its thread: nothing writes in the CDI directory once the node has
        stopped."""
        async with self._lock:
            gpus = await self._inventory.refresh(only)
            write = asyncio.ensure_future(asyncio.to_thread(self._cdi.write_node, gpus))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await write
                raise

    def schedule(self, gpu: str) -> None:
        """Rewrite the spec soon: the instances of the GPU with UUID ``gpu`` changed."""
        self._changed.add(gpu)
        self._stale.set()

    async def run(self) -> None:
        """Rewrite the spec each time it went stale (a task of the node)."""
        while True:
            await self._stale.wait()
            self._stale.clear()
            changed, self._changed = self._changed, set()
            try:
                await self.refresh(changed)
                await self._after()
            except Exception as err:  # derived state: log, and the next change retries it
                self._changed |= changed
                log.warning("node CDI spec refresh failed", extra={"error": str(err)})
