"""The publisher between a real agent process and a real kube-apiserver (tests/k8s): what the
server holds (owner, pool, generation, count), what happens to slices someone else deletes or
changes, a restarted publisher, a recreated Node, and a server that drops fields."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest

from agent.dra.rules import quantity
from agent.kubeplugin.publisher import ResourceSlicePublisher, kubernetes_version
from tests.k8s.fixtures import StartApiServer
from tests.k8s.harness import ApiServer
from tests.kubeplugin.conftest import DRIVER, Agent, NodeAgents
from tests.kubeplugin.publishing import (
    GOAL_S,
    Cluster,
    eventually,
    kube_client,
    make_publisher,
    names,
    on_server,
    running,
    sample,
    specs,
    versions,
)


def by_value(value: Any) -> Any:
    """A slice compared as the server means it: quantities by value (it writes them
    canonically, 81920Mi as 80Gi) and empty lists as absent."""
    if isinstance(value, dict):
        if set(value) == {"value"} and isinstance(value["value"], str):
            return quantity(value["value"])
        return {k: by_value(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [by_value(v) for v in value]
    return value


def publisher_in_sync(publisher: ResourceSlicePublisher) -> Callable[[], bool]:
    return lambda: publisher.health().in_sync


def served(agent: Agent, kubernetes: str) -> list[dict[str, Any]]:
    reply = agent.process.request("GET", f"/v1/resourceslices?kubernetes={kubernetes}")
    assert reply.status == 200, reply.body
    return list(reply.body["items"])


def stale_slice(node: str, generation: int) -> dict[str, Any]:
    """A slice of the node's pool that the agent does not serve (a previous plugin's)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-stale"},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": "stale-0"}]}}


@pytest.mark.parametrize(("server", "asked"), [((1, 33), "1.34"), ((1, 34), "1.34"),
                                               ((1, 36), "1.36"), ((1, 37), "1.37"),
                                               ((1, 40), "1.37"), ((2, 0), "1.37")])
def test_kubernetes_version_is_clamped(server: tuple[int, int], asked: str) -> None:
    """The agent is asked for the server's version, within the 1.34-1.37 it knows."""
    assert kubernetes_version(server) == asked


async def test_publishes_the_agents_pool_above_the_existing_generation(
        kube_apiserver: ApiServer, node_agent: NodeAgents) -> None:
    """The server gets the agent's slices for its own version, owned by the Node (controller,
    its UID), pooled under the node's name with the slice count, at a generation above the
    highest already there; the obsolete slice is deleted; health says in sync."""
    node = "pub-pool"
    cluster = Cluster(kube_apiserver, node)
    uid = await asyncio.to_thread(cluster.node_uid)
    await asyncio.to_thread(cluster.create, stale_slice(node, 7))
    agent = node_agent.start(node, dynamic_mig=True)
    kube = await kube_client(kube_apiserver.kubeconfig)
    publisher, registry, client = make_publisher(agent, kube, node=node)
    try:
        async with running(publisher) as task:
            await eventually(lambda: publisher.health().in_sync, task=task)
    finally:
        await client.close()
        await kube.close()
    assert publisher.kubernetes == kube_apiserver.version
    want = served(agent, kube_apiserver.version)
    stored = await asyncio.to_thread(cluster.slices)
    assert names(stored) == sorted(names(want)) and len(want) > 1
    assert by_value(specs(stored)) == by_value(specs(want))
    for item in stored:
        assert item["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}]
        assert item["spec"]["pool"] == {"name": node, "generation": 8,
                                        "resourceSliceCount": len(want)}
    assert sample(registry, "slice_publishes_total") == 1
    assert (sample(registry, "slice_last_sync_timestamp_seconds") or 0) > 0


@pytest.mark.parametrize("cause", ["deleted", "modified"])
async def test_slices_changed_by_someone_else_are_restored(
        cause: str, kube_apiserver: ApiServer, node_agent: NodeAgents) -> None:
    """Slices deleted (kubelet at its start) or changed behind the publisher's back are
    written again within the 2 s goal, counted by cause, above the generation seen."""
    node = f"pub-{cause}"
    cluster = Cluster(kube_apiserver, node)
    await asyncio.to_thread(cluster.node_uid)
    agent = node_agent.start(node)
    kube = await kube_client(kube_apiserver.kubeconfig)
    publisher, registry, client = make_publisher(agent, kube, node=node)
    try:
        async with running(publisher) as task:
            await eventually(lambda: publisher.health().in_sync, task=task)
            before = await asyncio.to_thread(cluster.slices)
            if cause == "deleted":
                assert await asyncio.to_thread(cluster.wipe) == len(before)
            else:
                tampered = copy.deepcopy(before[-1])
                tampered["spec"]["devices"] = tampered["spec"]["devices"][:1]
                await asyncio.to_thread(cluster.replace, tampered)
            took = await eventually(on_server(cluster, lambda now: specs(now) == specs(before)),
                                    within_s=GOAL_S, task=task)
            print(f"republished after slices {cause} by someone else in {took * 1000:.0f} ms")
            await eventually(lambda: sample(registry, "slice_republishes_total",
                                            cause=cause) == 1, task=task)
            after = await asyncio.to_thread(cluster.slices)
    finally:
        await client.close()
        await kube.close()
    generation = before[0]["spec"]["pool"]["generation"]
    assert {s["spec"]["pool"]["generation"] for s in after} == (
        {generation} if cause == "deleted" else {generation + 1})


async def test_a_restarted_publisher_rewrites_nothing(kube_apiserver: ApiServer,
                                                      node_agent: NodeAgents) -> None:
    """A second publisher (the plugin restarted) finds the pool the server holds in sync,
    quantities the server rewrote canonically included, and writes nothing."""
    node = "pub-restart"
    cluster = Cluster(kube_apiserver, node)
    await asyncio.to_thread(cluster.node_uid)
    agent = node_agent.start(node, preset="a100-pcie-bridged")
    written = [d["capacity"]["memory"]["value"] for s in served(agent, kube_apiserver.version)
               for d in s["spec"].get("devices", ())]
    assert "81920Mi" in written  # the server stores it as 80Gi
    kube = await kube_client(kube_apiserver.kubeconfig)
    try:
        for round_ in ("first", "second"):
            publisher, registry, client = make_publisher(agent, kube, node=node)
            try:
                async with running(publisher) as task:
                    await eventually(publisher_in_sync(publisher), task=task)
                    await asyncio.sleep(0.3)  # a write would show by now
            finally:
                await client.close()
            if round_ == "first":
                first = versions(await asyncio.to_thread(cluster.slices))
    finally:
        await kube.close()
    assert versions(await asyncio.to_thread(cluster.slices)) == first
    assert sample(registry, "slice_publishes_total") == 0


async def test_recreated_node_gets_slices_owned_by_its_new_uid(
        kube_apiserver: ApiServer, node_agent: NodeAgents) -> None:
    """When the Node is recreated and its slices deleted (the garbage collector's part), the
    slices are written again owned by the new Node's UID."""
    node = "pub-renode"
    cluster = Cluster(kube_apiserver, node)
    await asyncio.to_thread(cluster.node_uid)
    agent = node_agent.start(node)
    kube = await kube_client(kube_apiserver.kubeconfig)
    publisher, _, client = make_publisher(agent, kube, node=node)
    try:
        async with running(publisher) as task:
            await eventually(lambda: publisher.health().in_sync, task=task)
            new_uid = await asyncio.to_thread(cluster.recreate_node)
            await asyncio.to_thread(cluster.wipe)
            await eventually(on_server(cluster, lambda now: bool(now) and {
                s["metadata"]["ownerReferences"][0]["uid"] for s in now} == {new_uid}),
                task=task)
    finally:
        await client.close()
        await kube.close()


async def test_dropped_counters_withdraw_the_devices_that_consume_them(
        kube_apiservers: StartApiServer, node_agent: NodeAgents,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 1.34 server with DRAPartitionableDevices off accepts dynamic-MIG slices and drops
    their counters: the publisher reports it in health (not in sync, naming the fields), a
    metric and a log event, and fails closed: it rewrites the pool once without the devices
    that consume counters (the scheduler could book overlapping placements), then leaves it."""
    server = kube_apiservers("1.34", feature_gates="")
    node = "pub-dropped"
    cluster = Cluster(server, node)
    await asyncio.to_thread(cluster.node_uid)
    agent = node_agent.start(node, dynamic_mig=True)
    kube = await kube_client(server.kubeconfig)
    publisher, registry, client = make_publisher(agent, kube, node=node)
    dropped = ("spec.devices[].consumesCounters", "spec.sharedCounters")

    def partitionable(slices: list[dict[str, Any]]) -> list[str]:
        return [d["name"] for s in slices for d in s["spec"].get("devices") or []
                if "-mig-" in d["name"] or s["spec"].get("sharedCounters")]

    try:
        with caplog.at_level(logging.INFO, logger="agent.kubeplugin.publisher"):
            async with running(publisher) as task:
                await eventually(lambda: publisher.health().dropped_fields != (), task=task)
                await eventually(lambda: sample(registry, "slice_publishes_total") == 2,
                                 task=task)
                first = await asyncio.to_thread(cluster.slices)
                await asyncio.sleep(1.0)  # the watch saw its own writes; nothing more
                assert versions(await asyncio.to_thread(cluster.slices)) == versions(first)
    finally:
        await client.close()
        await kube.close()
    assert partitionable(first) == []
    health = publisher.health()
    assert health.dropped_fields == dropped
    assert not health.in_sync and all(f in (health.reason or "") for f in dropped)
    assert "withdrawn" in (health.reason or "")
    assert sample(registry, "slice_dropped_fields") == len(dropped)
    assert sample(registry, "slice_publishes_total") == 2
    events = [r for r in caplog.records
              if r.getMessage() == "api server dropped resourceslice fields"]
    assert [getattr(r, "fields", None) for r in events] == [",".join(dropped)]


async def test_dropped_shares_publish_the_gpus_whole(
        kube_apiservers: StartApiServer, node_agent: NodeAgents,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 1.34 server with DRAConsumableCapacity off accepts the shareable L40S slices of
    --gpu-shares and drops allowMultipleAllocations and the request policies: the publisher
    reports it (health naming the fields, metrics, one error log) and fails closed: it
    rewrites the pool once with every GPU whole (exclusive), then leaves it."""
    server = kube_apiservers("1.34", feature_gates="")
    node = "pub-shares"
    cluster = Cluster(server, node)
    await asyncio.to_thread(cluster.node_uid)
    agent = node_agent.start(node, preset="l40s", extra=("--gpu-shares",))
    assert all(d.get("allowMultipleAllocations") for s in served(agent, "1.34")
               for d in s["spec"]["devices"])
    kube = await kube_client(server.kubeconfig)
    publisher, registry, client = make_publisher(agent, kube, node=node)
    dropped = ("spec.devices[].allowMultipleAllocations",
               "spec.devices[].capacity.memory.requestPolicy")
    try:
        with caplog.at_level(logging.INFO, logger="agent.kubeplugin.publisher"):
            async with running(publisher) as task:
                await eventually(lambda: publisher.health().dropped_fields != (), task=task)
                await eventually(lambda: sample(registry, "slice_publishes_total") == 2,
                                 task=task)
                first = await asyncio.to_thread(cluster.slices)
                await asyncio.sleep(1.0)  # the watch saw its own writes; nothing more
                assert versions(await asyncio.to_thread(cluster.slices)) == versions(first)
    finally:
        await client.close()
        await kube.close()
    gpus = [d for s in first for d in s["spec"]["devices"]]
    assert [d["name"] for d in gpus] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert not any(d.get("allowMultipleAllocations") for d in gpus)
    assert not any("requestPolicy" in d["capacity"]["memory"] for d in gpus)
    health = publisher.health()
    assert health.dropped_fields == dropped
    assert not health.in_sync and "published whole, not shareable" in (health.reason or "")
    assert sample(registry, "slice_features_withdrawn", feature="shares") == 1
    assert sample(registry, "slice_features_withdrawn", feature="counters") == 0
    errors = [r for r in caplog.records if r.levelno == logging.ERROR
              and "consumable capacity" in r.getMessage()]
    assert len(errors) == 1
