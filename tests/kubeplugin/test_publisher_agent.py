"""The publisher between a real agent process (``--simulate dgx-h100 --dynamic-mig``) and the
in-memory API server: what the agent serves is what the server holds, within the 2 s goal
after a change or a wipe, and the pool goes while the agent is gone.

Swapping in a real kube-apiserver (tests/k8s) means passing its ``KubeClient`` instead of the
``MemorySliceApi`` and reading/wiping slices through it; nothing else here changes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.kubeplugin.memory_api import MemorySliceApi
from tests.agent_process import AgentProcess, start_agent
from tests.kubeplugin.publishing import (
    DRIVER,
    NODE,
    Answer,
    eventually,
    make_publisher,
    running,
    sample,
)

AGENT_ARGS = ["--dynamic-mig", "--driver-name", DRIVER]
#: The republish goal of issue 14.
GOAL_S = 2.0


class AgentSlices:
    """The agent's ``GET /v1/resourceslices`` over its Unix socket with the ETag long-poll
    (stands in for the plugin's ``AgentClient.resource_slices`` until they merge). An agent
    that sends no ETag yet is polled every 0.1 s with a digest of its answer as the ETag."""

    def __init__(self, agent: AgentProcess) -> None:
        self._agent = agent
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(agent.socket_path)))
        self._long_poll = False

    async def close(self) -> None:
        await self._session.close()

    async def resource_slices(self, kubernetes: str, etag: str | None,
                              wait_s: float) -> Answer:
        deadline = time.monotonic() + wait_s
        while True:
            params = {"kubernetes": kubernetes}
            headers = {"Authorization": f"Bearer {self._agent.token}"} if self._agent.token \
                else {}
            if etag and self._long_poll:
                params["wait_s"] = str(int(wait_s))
                headers["If-None-Match"] = etag
            async with self._session.get("http://agent/v1/resourceslices", params=params,
                                         headers=headers) as reply:
                if reply.status == 304:
                    return Answer(etag, None)
                reply.raise_for_status()
                body = await reply.json()
                served = reply.headers.get("ETag")
            self._long_poll = served is not None
            tag = served or hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            if tag != etag:
                return Answer(tag, body["items"])
            if time.monotonic() >= deadline:
                return Answer(etag, None)
            await asyncio.sleep(0.1)


def _start(state: Path) -> AgentProcess:
    return start_agent(state, extra=AGENT_ARGS, env={"NODE_NAME": NODE})


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[AgentProcess]:
    process = await asyncio.to_thread(_start, tmp_path / "state")
    try:
        yield process
    finally:
        await asyncio.to_thread(process.stop)


@pytest.fixture
async def source(agent: AgentProcess) -> AsyncIterator[AgentSlices]:
    slices = AgentSlices(agent)
    try:
        yield slices
    finally:
        await slices.close()


def _served(agent: AgentProcess) -> list[dict[str, Any]]:
    return list(agent.request("GET", "/v1/resourceslices?kubernetes=1.35").body["items"])


def _specs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Slices as (name, spec) with the pool's generation aside: what the agent decides."""
    out = []
    for item in items:
        spec = json.loads(json.dumps(item["spec"]))
        spec["pool"].pop("generation")
        out.append({"name": item["metadata"]["name"], "spec": spec})
    return out


def _uuids(api: MemorySliceApi) -> set[str]:
    return {attrs[key]["string"] for item in api.slices()
            for device in item["spec"].get("devices", ())
            for attrs in [device["attributes"]] for key in ("uuid", "parentUUID") if key in attrs}


async def test_server_holds_what_the_agent_serves(agent: AgentProcess,
                                                  source: AgentSlices) -> None:
    """The server's slices are the agent's, slice for slice, owned by the Node; a wipe is
    republished within the 2 s goal."""
    api = MemorySliceApi(version=(1, 35))
    uid = api.add_node(NODE)
    publisher, registry = make_publisher(source, api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, within_s=10, task=task)
        served = await asyncio.to_thread(_served, agent)
        assert _specs(api.slices()) == _specs(served)
        assert len(served) > 1  # counter sets and devices in separate slices from 1.35
        assert {s["metadata"]["ownerReferences"][0]["uid"] for s in api.slices()} == {uid}
        api.wipe(NODE)
        took = await eventually(lambda: len(api.slices()) == len(served), within_s=GOAL_S,
                                task=task)
        print(f"republished after a wipe in {took * 1000:.0f} ms")
    assert sample(registry, "slice_republishes_total", cause="deleted") == 1


async def test_a_health_change_is_republished_within_the_goal(agent: AgentProcess,
                                                              source: AgentSlices) -> None:
    """A GPU that falls off the bus (XID 79) leaves the server's slices within 2 s."""
    api = MemorySliceApi(version=(1, 35))
    api.add_node(NODE)
    publisher, _ = make_publisher(source, api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, within_s=10, task=task)
        uuid = (await asyncio.to_thread(agent.request, "GET", "/v1/gpus/7")).body["uuid"]
        assert uuid in _uuids(api)
        reply = await asyncio.to_thread(agent.request, "POST", "/v1/sim/xid",
                                        {"gpu": uuid, "xid": 79})
        assert reply.status == 202
        took = await eventually(lambda: uuid not in _uuids(api), within_s=GOAL_S, task=task)
        print(f"republished after XID 79 in {took * 1000:.0f} ms")
        assert _specs(api.slices()) == _specs(await asyncio.to_thread(_served, agent))


async def test_agent_gone_deletes_the_pool_and_back_republishes(tmp_path: Path) -> None:
    """A stopped agent has its pool deleted after agent_lost_after_s; once the restarted
    agent answers, its pool is published again."""
    state = tmp_path / "state"
    agent = await asyncio.to_thread(_start, state)
    source = AgentSlices(agent)
    api = MemorySliceApi(version=(1, 35))
    api.add_node(NODE)
    publisher, registry = make_publisher(source, api, lost_after_s=1.0)
    try:
        async with running(publisher) as task:
            await eventually(lambda: publisher.health().in_sync, within_s=10, task=task)
            count, stopped = len(api.slices()), time.monotonic()
            await asyncio.to_thread(agent.stop)
            await eventually(lambda: api.slices() == [], within_s=5, task=task)
            assert time.monotonic() - stopped >= 1.0
            assert sample(registry, "slice_pool_deletions_total") == 1
            agent = await asyncio.to_thread(_start, state)
            await eventually(lambda: len(api.slices()) == count, within_s=10, task=task)
            await eventually(lambda: publisher.health().in_sync, task=task)
    finally:
        await source.close()
        await asyncio.to_thread(agent.stop)
    assert sample(registry, "slice_republishes_total", cause="agent_returned") == 1
