"""Running a SlicePublisher in a test: a scripted agent, the publisher as a task, and waiting
for a condition. The API server side is any SliceApi: the in-memory one now, a real
kube-apiserver (tests/k8s) by passing its client instead."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from agent.kubeplugin.kube import SliceApi
from agent.kubeplugin.publisher import Backoff, SlicePublisher

NODE, DRIVER = "node-a", "gpu.nodeagent.dev"
#: Fast retries: a test's outage lasts tenths of a second.
FAST = Backoff(initial_s=0.01, max_s=0.05)
Json = dict[str, Any]


@dataclass(frozen=True)
class Answer:
    etag: str | None
    items: list[Json] | None


class ScriptedAgent:
    """An agent's ``GET /v1/resourceslices`` long-poll, with content and outages set by the
    test."""

    def __init__(self, items: list[Json]) -> None:
        self.items = items
        self.version = 1
        self.down = False
        self.asked: list[str] = []
        self._changed = asyncio.Event()

    def set(self, items: list[Json]) -> None:
        self.items, self.version = items, self.version + 1
        self._wake()

    def go_down(self) -> None:
        """Refuse every call from now on, ending a held long-poll; the content stays, so
        an agent back up answers the old ETag with "unchanged"."""
        self.down = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def resource_slices(self, kubernetes: str, etag: str | None,
                              wait_s: float) -> Answer:
        self.asked.append(kubernetes)
        if self.down:
            raise ConnectionRefusedError("agent socket refused")
        if etag == str(self.version):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
            if self.down:
                raise ConnectionResetError("agent went away")
            if etag == str(self.version):
                return Answer(etag, None)
        return Answer(str(self.version), copy.deepcopy(self.items))


def agent_slice(name: str, *devices: str, generation: int = 1,
                extra: Json | None = None) -> Json:
    """A slice as the agent renders it."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                     "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": d, "attributes": {"type": {"string": "gpu"}},
                                  **(extra or {})} for d in devices]}}


def make_publisher(agent: Any, api: SliceApi, *, lost_after_s: float = 60.0,
                   node: str = NODE) -> tuple[SlicePublisher, CollectorRegistry]:
    """A publisher with fast retries, and the registry of its metrics."""
    registry = CollectorRegistry()
    return SlicePublisher(agent, api, node_name=node, driver=DRIVER,
                          agent_lost_after_s=lost_after_s, registry=registry,
                          backoff=FAST), registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A metric of the publisher (``gpu_agent_plugin_<name>``; 0 when absent)."""
    value = registry.get_sample_value(f"gpu_agent_plugin_{name}", labels or None)
    return value or 0.0


@contextlib.asynccontextmanager
async def running(publisher: SlicePublisher) -> AsyncIterator[asyncio.Task[None]]:
    """The publisher's ``run()`` as a task for the block; cancelled after it."""
    task = asyncio.create_task(publisher.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(check: Callable[[], bool], *, within_s: float = 5.0,
                     task: asyncio.Task[None] | None = None) -> float:
    """Wait until ``check()`` holds; the seconds it took (AssertionError past ``within_s``,
    or the task's own exception if it died)."""
    start = time.monotonic()
    while not check():
        if task is not None and task.done():
            task.result()
            raise AssertionError("the publisher stopped")
        if time.monotonic() - start > within_s:
            raise AssertionError(f"not within {within_s}s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start
