"""Running a ResourceSlicePublisher in a test between real parts: a real agent process (the plugin's
own ``AgentClient`` on its Unix socket, with the ``claims`` token) and a real kube-apiserver
from tests/k8s (the plugin's own ``KubeClient`` from a kubeconfig). The test reads and
changes the server's slices as an administrator would, over HTTPS."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.kube import SLICES_PATH, KubeClient
from agent.kubeplugin.publisher import Backoff, ResourceSlicePublisher
from tests.k8s.harness import ApiServer
from tests.kubeplugin.conftest import DRIVER, Agent
from tests.waiting import until

#: Fast retries: a test's outage lasts tenths of a second.
FAST = Backoff(initial_s=0.01, max_s=0.05)
#: The republish goal of issue 14 (a geometry or health change, a wipe).
GOAL_S = 2.0
Json = dict[str, Any]


@dataclass
class Cluster:
    """One node's view of a real API server: its slices of this driver, read and changed with
    the administrator's token (blocking calls: run them with :func:`asyncio.to_thread`)."""

    server: ApiServer
    node: str

    @property
    def selector(self) -> str:
        return f"fieldSelector=spec.driver={DRIVER},spec.nodeName={self.node}"

    def slices(self) -> list[Json]:
        """The node's slices on the server, by name."""
        status, listing = self.server.request("GET", f"{SLICES_PATH}?{self.selector}")
        assert status == 200, listing
        return sorted(listing["items"], key=lambda s: s["metadata"]["name"])

    def wipe(self) -> int:
        """Delete every slice of the node in one call, as kubelet does when it starts; how
        many went."""
        status, gone = self.server.request("DELETE", f"{SLICES_PATH}?{self.selector}")
        assert status == 200, gone
        return len(gone.get("items") or [])

    def create(self, body: Json) -> Json:
        status, stored = self.server.request("POST", SLICES_PATH, body)
        assert status == 201, stored
        return dict(stored)

    def replace(self, body: Json) -> Json:
        status, stored = self.server.request("PUT", f"{SLICES_PATH}/{body['metadata']['name']}",
                                             body)
        assert status == 200, stored
        return dict(stored)

    def node_uid(self) -> str:
        return str(self.server.ensure_node(self.node)["metadata"]["uid"])

    def recreate_node(self) -> str:
        """Delete the Node and create it again (a new UID); the new UID."""
        status, answer = self.server.request("DELETE", f"/api/v1/nodes/{self.node}")
        assert status == 200, answer
        return self.node_uid()


def names(items: list[Json]) -> list[str]:
    return [s["metadata"]["name"] for s in items]


def specs(items: list[Json]) -> list[Json]:
    """Slices as (name, spec) with the pool aside: what the agent decides."""
    out = []
    for item in items:
        spec = {k: v for k, v in item["spec"].items() if k != "pool"}
        out.append({"name": item["metadata"]["name"], "spec": spec})
    return out


def versions(items: list[Json]) -> dict[str, str]:
    """Each slice's resourceVersion: unchanged means not written."""
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in items}


async def kube_client(kubeconfig: Path) -> KubeClient:
    return await KubeClient.from_environment(kubeconfig)


def make_publisher(agent: Agent, kube: KubeClient, *, node: str, lost_after_s: float = 60.0
                   ) -> tuple[ResourceSlicePublisher, CollectorRegistry, AgentClient]:
    """A publisher with fast retries on the plugin's own clients; its metrics' registry and
    the agent client (close it after)."""
    registry = CollectorRegistry()
    client = AgentClient(agent.process.socket_path, agent.token_file)
    return ResourceSlicePublisher(client, kube, node_name=node, driver=DRIVER,
                          agent_lost_after_s=lost_after_s, registry=registry,
                          backoff=FAST), registry, client


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A metric of the publisher (``gpu_agent_plugin_<name>``; 0 when absent)."""
    value = registry.get_sample_value(f"gpu_agent_plugin_{name}", labels or None)
    return value or 0.0


@contextlib.asynccontextmanager
async def running(publisher: ResourceSlicePublisher) -> AsyncIterator[asyncio.Task[None]]:
    """The publisher's ``run()`` as a task for the block; cancelled after it."""
    task = asyncio.create_task(publisher.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


Check = Callable[[], bool | Awaitable[bool]]


async def eventually(check: Check, *, within_s: float = 10.0,
                     task: asyncio.Task[None] | None = None, every_s: float = 0.02) -> float:
    """Wait until ``check()`` (sync, or async) holds; the seconds it took (AssertionError
    past ``within_s``, or the task's own exception if it died)."""
    start = time.monotonic()

    async def holds() -> bool:
        if task is not None and task.done():
            task.result()
            raise AssertionError("the publisher stopped")
        result = check()
        return bool(await result if inspect.isawaitable(result) else result)
    await until(holds, "the check", within_s, every_s=every_s)
    return time.monotonic() - start


def on_server(cluster: Cluster, want: Callable[[list[Json]], bool]) -> Check:
    """A check of the server's slices, read off the event loop."""
    async def check() -> bool:
        return want(await asyncio.to_thread(cluster.slices))
    return check
