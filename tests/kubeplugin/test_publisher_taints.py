"""Device taints through the publisher onto real kube-apiservers (tests/k8s): published
tainted where the server keeps taints (1.37; 1.34 with DRADeviceTaints), and where it does not
(1.34's default) known before the first write, so a device with a blocking taint is withdrawn
and never written untainted, which the server's own watch history shows; a write that loses
its taints or is refused for them falls back at once, never wedged.

The agent renders taints itself once issue 23's agent side lands; until then the real agent's
answers get the taints its contract describes added here (:class:`TaintingAgent`)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.health import HealthServer, Readiness
from agent.kubeplugin.kube import KubeClient, WatchEvent
from agent.kubeplugin.publisher import ResourceSlicePublisher
from agent.kubeplugin.servers import RegistrationState
from tests.k8s.fixtures import StartApiServer
from tests.k8s.harness import ApiServer
from tests.kubeplugin.conftest import DRIVER, Agent, NodeAgents
from tests.kubeplugin.publishing import (
    FAST,
    Cluster,
    eventually,
    kube_client,
    running,
    sample,
    versions,
)

Json = dict[str, Any]
ADDED = "2026-12-02T16:40:01Z"
XID48 = {"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule", "timeAdded": ADDED}
#: Informational: the agent leaves it out for 1.34 (no effect None there) and renders it from
#: 1.35; a 1.34 server with the gate refuses it (422).
XID31 = {"key": f"{DRIVER}/xid", "value": "31", "effect": "None", "timeAdded": ADDED}
FAULTY, APPLICATION = "gpu-1", "gpu-2"
ERRORS = "api server keeps no device taints"


@dataclass(frozen=True)
class Answer:
    etag: str | None
    items: list[Json] | None


class TaintingAgent:
    """The plugin's own client of the real agent, its slices' devices given ``taints`` (device
    name -> taints), as the agent of issue 23 renders them."""

    def __init__(self, client: AgentClient, taints: dict[str, list[Json]]) -> None:
        self._client = client
        self._taints = taints

    async def resource_slices(self, kubernetes: str, etag: str | None,
                              wait_s: float) -> Answer:
        answer = await self._client.resource_slices(kubernetes, etag, wait_s)
        if answer.items is None:
            return Answer(answer.etag, None)
        items = copy.deepcopy(answer.items)
        for item in items:
            for device in item["spec"].get("devices") or []:
                if device["name"] in self._taints:
                    device["taints"] = copy.deepcopy(self._taints[device["name"]])
        return Answer(answer.etag, items)


@dataclass
class History:
    """Every event of the node's slices on the server, from before the publisher started,
    watched with the administrator's credentials."""

    events: list[WatchEvent] = field(default_factory=list)

    def devices(self, name: str) -> list[Json]:
        """Device ``name`` in each created or modified slice that held it, in order."""
        return [d for e in self.events if e.type in ("ADDED", "MODIFIED")
                for d in e.object["spec"].get("devices") or [] if d["name"] == name]

    def seen(self, stored: list[Json]) -> bool:
        """Whether the watch has come up to what the server holds now."""
        latest = {e.object["metadata"]["name"]: e.resource_version for e in self.events}
        return all(latest.get(name) == version for name, version in versions(stored).items())


@contextlib.asynccontextmanager
async def history_of(server: ApiServer, node: str) -> AsyncIterator[History]:
    kube = await kube_client(server.kubeconfig)
    history = History()
    listing = await kube.list_resource_slices(driver=DRIVER, node=node)

    async def watch() -> None:
        async for event in kube.watch_resource_slices(
                driver=DRIVER, node=node, resource_version=listing.resource_version):
            history.events.append(event)
    task = asyncio.create_task(watch())
    try:
        yield history
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()


@dataclass
class Node:
    """One node's publisher between the real agent (tainted as asked) and a real server, and
    the plugin's /readyz over it."""

    cluster: Cluster
    publisher: ResourceSlicePublisher
    registry: CollectorRegistry
    readyz_url: str

    async def readyz(self) -> tuple[int, Json]:
        async with aiohttp.ClientSession() as session, session.get(self.readyz_url) as reply:
            return reply.status, await reply.json()


@contextlib.asynccontextmanager
async def node_of(server: ApiServer, agent: Agent, node: str, taints: dict[str, list[Json]],
                  kube: KubeClient | None = None) -> AsyncIterator[Node]:
    client = AgentClient(agent.process.socket_path, agent.token_file)
    own = kube is None
    kube = kube or await kube_client(server.kubeconfig)
    registry = CollectorRegistry()
    publisher = ResourceSlicePublisher(TaintingAgent(client, taints), kube, node_name=node,
                                       driver=DRIVER, registry=registry, backoff=FAST)
    health = HealthServer("127.0.0.1:0", Readiness(RegistrationState(registered=True),
                                                   client, api=kube, publisher=publisher),
                          registry)
    await health.start()
    assert health.address is not None
    try:
        yield Node(Cluster(server, node), publisher, registry,
                   f"http://127.0.0.1:{health.address[1]}/readyz")
    finally:
        await health.stop()
        await client.close()
        if own:
            await kube.close()


def device_map(slices: list[Json]) -> dict[str, Json]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def taints_of(device: Json) -> list[tuple[str, str | None, str, str | None]]:
    return [(t["key"], t.get("value"), t["effect"], t.get("timeAdded"))
            for t in device.get("taints") or []]


def as_tuples(*taints: Json) -> list[tuple[str, str | None, str, str | None]]:
    return taints_of({"taints": list(taints)})


@pytest.fixture
def info_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="agent.kubeplugin.publisher"):
        yield caplog


#: Servers that keep taints (their default gates: 1.34's in the tests turn DRADeviceTaints
#: on), and the taints the agent renders for each (effect None only from 1.35).
KEEPING = {"1.37": {FAULTY: [XID48], APPLICATION: [XID31]}, "1.34": {FAULTY: [XID48]}}


@pytest.mark.parametrize("version", list(KEEPING), ids=["1.37", "1.34-with-DRADeviceTaints"])
async def test_taints_are_published_where_the_server_keeps_them(
        version: str, kube_apiservers: StartApiServer, node_agent: NodeAgents,
        info_logs: pytest.LogCaptureFixture) -> None:
    """A server that keeps taints gets every device, the faulty one with its taints as the
    agent rendered them, from the first write on; in sync, ready, nothing withdrawn."""
    server, taints = kube_apiservers(version), KEEPING[version]
    name = f"taints-kept-v{version}".replace(".", "-")
    await asyncio.to_thread(Cluster(server, name).node_uid)
    agent = node_agent.start(name, preset="l40s")
    async with history_of(server, name) as history, \
            node_of(server, agent, name, taints) as node, running(node.publisher) as task:
        await eventually(lambda: node.publisher.health().in_sync, task=task)
        status, ready = await node.readyz()
        stored = await asyncio.to_thread(node.cluster.slices)
        await eventually(lambda: history.seen(stored), task=task)
    assert status == 200, ready
    devices = device_map(stored)
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    for device, want in taints.items():
        assert taints_of(devices[device]) == as_tuples(*want)
    assert [taints_of(d) for d in history.devices(FAULTY)] == [as_tuples(XID48)]
    assert sample(node.registry, "slice_features_withdrawn", feature="taints") == 0
    assert sample(node.registry, "slice_features_withdrawn",
                  feature="informational_taints") == 0
    assert sample(node.registry, "slice_publishes_total") == 1
    assert [r.getMessage() for r in info_logs.records
            if r.getMessage().startswith("api server")] == ["api server keeps device taints"]


async def test_a_server_without_taints_never_shows_a_faulty_device_untainted(
        kube_apiservers: StartApiServer, node_agent: NodeAgents,
        info_logs: pytest.LogCaptureFixture) -> None:
    """On 1.34 without DRADeviceTaints (its default) the dry-run probe finds, before the first
    write, that taints would be dropped: the device with a blocking taint is withdrawn from
    the first write on (the server's watch history never holds it), the informational taint
    (as the agent renders it for 1.35 with the gate off) is left out, and /readyz, the
    metrics and one error log say why."""
    server = kube_apiservers("1.34", feature_gates="")
    name = "taints-none-v1-34"
    await asyncio.to_thread(Cluster(server, name).node_uid)
    agent = node_agent.start(name, preset="l40s")
    taints = {FAULTY: [XID48], APPLICATION: [XID31]}
    async with history_of(server, name) as history, \
            node_of(server, agent, name, taints) as node, running(node.publisher) as task:
        await eventually(lambda: sample(node.registry, "slice_publishes_total") == 1,
                         task=task)
        status, ready = await node.readyz()
        stored = await asyncio.to_thread(node.cluster.slices)
        await eventually(lambda: history.seen(stored), task=task)
        assert versions(await asyncio.to_thread(node.cluster.slices)) == versions(stored)
    devices = device_map(stored)
    assert sorted(devices) == ["gpu-0", "gpu-2", "gpu-3"]
    assert all("taints" not in d for d in devices.values())
    assert history.devices(FAULTY) == []  # never written, so never untainted
    assert history.events and all(e.type == "ADDED" for e in history.events)
    health = node.publisher.health()
    # Reported, not failing: the node works, minus its faulty device.
    assert health.in_sync and health.dropped_fields == ()
    assert f"keeps no device taints (DRADeviceTaints off?; found by a dry-run create): " \
        f"devices with a blocking taint withdrawn: {FAULTY} ({DRIVER}/xid=48:NoSchedule); " \
        "informational taints left out: 1" in (health.withheld or "")
    assert status == 200 and f"{FAULTY} ({DRIVER}/xid=48:NoSchedule)" in \
        ready["warnings"]["taints"]
    assert sample(node.registry, "slice_features_withdrawn", feature="taints") == 1
    assert sample(node.registry, "slice_tainted_devices_withdrawn") == 1
    assert sample(node.registry, "slice_features_withdrawn", feature="counters") == 0
    assert [r.getMessage() for r in info_logs.records if r.levelno >= logging.WARNING
            and r.name == "agent.kubeplugin.publisher"] == [
        f"{ERRORS}: devices with a blocking taint withdrawn, informational taints left out "
        "(enable DRADeviceTaints on the API server and the scheduler)"]


async def test_a_server_without_taints_and_nothing_tainted_is_ready(
        kube_apiservers: StartApiServer, node_agent: NodeAgents) -> None:
    """The fallback hides nothing while no device is tainted: on 1.34's default every device
    is published, in sync and ready, and only the metric says taints would be withdrawn."""
    server = kube_apiservers("1.34", feature_gates="")
    name = "taints-dormant-v1-34"
    await asyncio.to_thread(Cluster(server, name).node_uid)
    agent = node_agent.start(name, preset="l40s")
    async with node_of(server, agent, name, {}) as node, running(node.publisher) as task:
        await eventually(lambda: node.publisher.health().in_sync, task=task)
        status, ready = await node.readyz()
        stored = await asyncio.to_thread(node.cluster.slices)
    assert status == 200, ready
    assert sorted(device_map(stored)) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert sample(node.registry, "slice_features_withdrawn", feature="taints") == 1
    assert sample(node.registry, "slice_tainted_devices_withdrawn") == 0


class ProbedElsewhere(KubeClient):
    """The plugin's client, but its dry run answered by a server that keeps taints (another
    API server behind the same address, mid-upgrade): only the real writes show the truth."""

    async def create_resource_slice(self, body: Json, *, dry_run: bool = False) -> Json:
        if dry_run:
            return {**copy.deepcopy(body), "metadata": {"name": "probe", "uid": "u"}}
        return await super().create_resource_slice(body)


async def test_a_write_that_loses_its_taints_withdraws_the_device_at_once(
        kube_apiservers: StartApiServer, node_agent: NodeAgents,
        info_logs: pytest.LogCaptureFixture) -> None:
    """The safety net behind the probe: a write whose answer lacks its taints (1.34 without
    the gate, the probe having said otherwise) switches to the fallback at once: the next
    write withdraws the faulty device, and health and the metric say a write dropped them."""
    server = kube_apiservers("1.34", feature_gates="")
    name = "taints-dropped-v1-34"
    await asyncio.to_thread(Cluster(server, name).node_uid)
    agent = node_agent.start(name, preset="l40s")
    kube = await ProbedElsewhere.from_environment(server.kubeconfig)
    try:
        async with history_of(server, name) as history, \
                node_of(server, agent, name, {FAULTY: [XID48]}, kube=kube) as node, \
                running(node.publisher) as task:
            await eventually(lambda: sample(node.registry, "slice_publishes_total") == 2,
                             task=task)
            stored = await asyncio.to_thread(node.cluster.slices)
            await eventually(lambda: history.seen(stored), task=task)
    finally:
        await kube.close()
    assert sorted(device_map(stored)) == ["gpu-0", "gpu-2", "gpu-3"]
    # Written once untainted (what the probe is there to prevent), then withdrawn.
    assert [taints_of(d) for d in history.devices(FAULTY)] == [[]]
    health = node.publisher.health()
    assert "keeps no device taints (DRADeviceTaints off?; a write dropped them)" in (
        health.withheld or "")
    assert health.dropped_fields == ()
    assert sample(node.registry, "slice_features_withdrawn", feature="taints") == 1
    assert len([r for r in info_logs.records if r.getMessage().startswith(ERRORS)]) == 1


async def test_a_refused_informational_taint_is_left_out_not_retried_forever(
        kube_apiservers: StartApiServer, node_agent: NodeAgents) -> None:
    """A 1.34 server with DRADeviceTaints refuses effect None (422): the publisher is not
    wedged retrying it; it writes the pool again at once without informational taints,
    keeping the blocking one, and says so (health, metric, error counted)."""
    server = kube_apiservers("1.34")
    name = "taints-refused-v1-34"
    await asyncio.to_thread(Cluster(server, name).node_uid)
    agent = node_agent.start(name, preset="l40s")
    async with history_of(server, name) as history, \
            node_of(server, agent, name, {FAULTY: [XID48], APPLICATION: [XID31]}) as node, \
            running(node.publisher) as task:
        await eventually(lambda: sample(node.registry, "slice_publishes_total") == 1,
                         task=task)
        stored = await asyncio.to_thread(node.cluster.slices)
        await eventually(lambda: history.seen(stored), task=task)
        status, ready = await node.readyz()
    devices = device_map(stored)
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert taints_of(devices[FAULTY]) == as_tuples(XID48)
    assert "taints" not in devices[APPLICATION]
    assert [taints_of(d) for d in history.devices(FAULTY)] == [as_tuples(XID48)]
    health = node.publisher.health()
    assert "refuses informational device taints (effect None; a write refused: 422" in (
        health.withheld or "")
    assert status == 200 and "informational taints left out: 1" in ready["warnings"]["taints"]
    assert sample(node.registry, "slice_features_withdrawn", feature="informational_taints") == 1
    assert sample(node.registry, "slice_features_withdrawn", feature="taints") == 0
    assert sample(node.registry, "slice_publisher_errors_total", kind="invalid") == 1
