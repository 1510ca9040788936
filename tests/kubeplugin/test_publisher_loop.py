"""The publisher's loop against a scripted agent and the in-memory API server: what reaches
the server, and how it recovers from wipes, outages, a lost agent and dropped fields."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.kubeplugin.memory_api import MemorySliceApi
from agent.kubeplugin.publisher import kubernetes_version
from tests.kubeplugin.publishing import (
    DRIVER,
    NODE,
    ScriptedAgent,
    agent_slice,
    eventually,
    make_publisher,
    running,
    sample,
)

POOL = [agent_slice("node-a-s-0", "gpu-0", "gpu-1"), agent_slice("node-a-s-1", "gpu-2")]


def cluster(**options: object) -> tuple[MemorySliceApi, str]:
    api = MemorySliceApi(**options)  # type: ignore[arg-type]
    return api, api.add_node(NODE)


def devices(api: MemorySliceApi) -> list[list[str]]:
    return [[d["name"] for d in s["spec"].get("devices", [])]
            for s in api.slices(driver=DRIVER, node=NODE)]


@pytest.mark.parametrize(("server", "asked"), [((1, 33), "1.34"), ((1, 34), "1.34"),
                                               ((1, 36), "1.36"), ((1, 37), "1.37"),
                                               ((1, 40), "1.37"), ((2, 0), "1.37")])
def test_kubernetes_version_is_clamped(server: tuple[int, int], asked: str) -> None:
    """The agent is asked for the server's version, within the 1.34-1.37 it knows."""
    assert kubernetes_version(server) == asked


async def test_publishes_the_agents_pool() -> None:
    """The server gets the agent's slices, owned by the Node, pooled under the node's name
    with the slice count, for the server's version; health says in sync."""
    api, uid = cluster(version=(1, 36))
    agent = ScriptedAgent(POOL)
    publisher, registry = make_publisher(agent, api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
    stored = api.slices(driver=DRIVER, node=NODE)
    assert [s["metadata"]["name"] for s in stored] == ["node-a-s-0", "node-a-s-1"]
    assert devices(api) == [["gpu-0", "gpu-1"], ["gpu-2"]]
    for item in stored:
        assert item["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]
        assert item["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}
    assert set(agent.asked) == {"1.36"}
    assert sample(registry, "slice_publishes_total") == 1
    assert (sample(registry, "slice_last_sync_timestamp_seconds") or 0) > 0


async def test_agent_change_is_republished() -> None:
    """A change the agent's long-poll reports reaches the server at the agent's generation."""
    api, _ = cluster()
    agent = ScriptedAgent(POOL)
    publisher, registry = make_publisher(agent, api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        agent.set([agent_slice("node-a-s-0", "gpu-0", generation=2)])
        await eventually(lambda: devices(api) == [["gpu-0"]], within_s=2, task=task)
    assert {s["spec"]["pool"]["generation"] for s in api.slices()} == {2}
    assert sample(registry, "slice_publishes_total") == 2
    assert sample(registry, "slice_republishes_total", cause="deleted") == 0


@pytest.mark.parametrize("cause", ["deleted", "modified"])
async def test_slices_changed_by_someone_else_are_restored(cause: str) -> None:
    """Slices deleted (kubelet at its start) or changed behind the publisher's back are
    written again within seconds, counted by cause, above the generation seen."""
    api, _ = cluster()
    publisher, registry = make_publisher(ScriptedAgent(POOL), api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        if cause == "deleted":
            assert api.wipe(NODE) == 2
        else:
            tampered = api.slices()[1]
            tampered["spec"]["devices"] = []
            await api.update_resource_slice(tampered)
        await eventually(lambda: devices(api) == [["gpu-0", "gpu-1"], ["gpu-2"]],
                         within_s=2, task=task)
        await eventually(lambda: sample(registry, "slice_republishes_total", cause=cause) == 1,
                         task=task)
    generations = {s["spec"]["pool"]["generation"] for s in api.slices()}
    assert generations == ({1} if cause == "deleted" else {2})


async def test_api_server_outage_is_retried() -> None:
    """While the API server is down the publisher retries (counted, health says why) and
    publishes once it is back."""
    api, _ = cluster()
    api.set_available(False)
    publisher, registry = make_publisher(ScriptedAgent(POOL), api)
    async with running(publisher) as task:
        await eventually(lambda: sample(registry, "slice_publisher_errors_total",
                                        kind="unavailable") >= 3, task=task)
        health = publisher.health()
        assert not health.in_sync and "KubeUnavailable" in (health.reason or "")
        api.set_available(True)
        await eventually(lambda: publisher.health().in_sync, task=task)
        assert len(api.slices()) == 2
        api.set_available(False)
        await asyncio.sleep(0.05)
        assert api.wipe(NODE) == 2  # the server lost them while down
        api.set_available(True)
        await eventually(lambda: len(api.slices()) == 2, within_s=2, task=task)


async def test_lost_agent_deletes_the_pool_until_it_is_back() -> None:
    """An agent silent for longer than agent_lost_after_s has its pool deleted (counted,
    health says so); when it answers again the pool is published again."""
    api, _ = cluster()
    agent = ScriptedAgent(POOL)
    publisher, registry = make_publisher(agent, api, lost_after_s=0.3)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        agent.go_down()
        took = await eventually(lambda: api.slices() == [], within_s=3, task=task)
        assert took >= 0.25
        assert sample(registry, "slice_pool_deletions_total") == 1
        health = publisher.health()
        assert not health.in_sync and "pool deleted" in (health.reason or "")
        agent.down = False
        await eventually(lambda: len(api.slices()) == 2, within_s=3, task=task)
        await eventually(lambda: publisher.health().in_sync, task=task)
    assert sample(registry, "slice_republishes_total", cause="agent_returned") == 1


async def test_a_short_agent_outage_keeps_the_pool() -> None:
    """An agent restart shorter than agent_lost_after_s leaves the published pool alone."""
    api, _ = cluster()
    agent = ScriptedAgent(POOL)
    publisher, registry = make_publisher(agent, api, lost_after_s=30)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        agent.go_down()
        await eventually(lambda: sample(registry, "slice_publisher_errors_total",
                                        kind="agent") >= 3, task=task)
        assert len(api.slices()) == 2
        agent.down = False
        await eventually(lambda: publisher.health().in_sync, task=task)
    assert api.calls.get("delete", 0) == 0
    assert sample(registry, "slice_pool_deletions_total") == 0


async def test_a_restarted_publisher_rewrites_nothing() -> None:
    """A second publisher (the plugin restarted) finds the pool in sync and writes nothing."""
    api, _ = cluster()
    first, _ = make_publisher(ScriptedAgent(POOL), api)
    async with running(first) as task:
        await eventually(lambda: first.health().in_sync, task=task)
    writes = (api.calls.get("create", 0), api.calls.get("update", 0))
    second, registry = make_publisher(ScriptedAgent(POOL), api)
    async with running(second) as task:
        await eventually(lambda: second.health().in_sync, task=task)
    assert (api.calls.get("create", 0), api.calls.get("update", 0)) == writes
    assert sample(registry, "slice_publishes_total") == 0


async def test_recreated_node_gets_slices_owned_by_its_new_uid() -> None:
    """When the Node is recreated (the garbage collector then deletes the slices), the
    slices are written again with the new Node's UID."""
    api, _ = cluster()
    publisher, _ = make_publisher(ScriptedAgent(POOL), api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        new_uid = api.add_node(NODE)
        api.wipe(NODE)
        await eventually(lambda: {s["metadata"]["ownerReferences"][0]["uid"]
                                  for s in api.slices()} == {new_uid}, within_s=2, task=task)


async def test_expired_watch_lists_again() -> None:
    """A watch whose history the server compacted starts over from a list, and still sees
    the wipe that follows."""
    api, _ = cluster()
    publisher, _ = make_publisher(ScriptedAgent(POOL), api)
    async with running(publisher) as task:
        await eventually(lambda: publisher.health().in_sync, task=task)
        lists = api.calls["list"]
        api.compact()
        await eventually(lambda: api.calls["list"] > lists + 1, task=task)
        api.wipe(NODE)
        await eventually(lambda: len(api.slices()) == 2, within_s=2, task=task)


COUNTED = {"consumesCounters": [{"counterSet": "gpu-0-counter-set",
                                 "counters": {"memory": {"value": "10Gi"}}}]}


async def test_dropped_fields_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A server that drops written fields (a feature gate off) is reported in health, a
    metric and a log event naming the fields, without rewriting the slices in a loop."""
    api, _ = cluster(drops=["spec.devices[].consumesCounters"])
    pool = [agent_slice("node-a-s-0", "gpu-0-mig-1g", extra=COUNTED)]
    publisher, registry = make_publisher(ScriptedAgent(pool), api)
    with caplog.at_level(logging.WARNING, logger="agent.kubeplugin.publisher"):
        async with running(publisher) as task:
            await eventually(lambda: publisher.health().dropped_fields != (), task=task)
            api.compact()  # a fresh list and plan: still nothing to write
            await asyncio.sleep(0.1)
    health = publisher.health()
    assert health.dropped_fields == ("spec.devices[].consumesCounters",)
    assert not health.in_sync and "spec.devices[].consumesCounters" in (health.reason or "")
    assert sample(registry, "slice_dropped_fields") == 1
    assert (api.calls.get("create", 0), api.calls.get("update", 0)) == (1, 0)
    events = [r for r in caplog.records if r.getMessage() == "api server dropped "
              "resourceslice fields"]
    assert [getattr(r, "fields", None) for r in events] == ["spec.devices[].consumesCounters"]
