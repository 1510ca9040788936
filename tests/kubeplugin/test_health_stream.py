"""Kubelet's DRA health stream, from kubelet's side of the real plugin process: a real agent
(``--simulate dgx-h100``), ``gpu-agent kubelet-plugin`` publishing to a real kube-apiserver
(its publisher is where device health comes from), and this test calling
``NodeWatchResources`` (v1 and v1alpha1) and the DRA service over the plugin's Unix socket
with the generated stubs, as kubelet does."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from agent.kubeplugin.health_stream import TIMEOUT_S
from agent.kubeplugin.proto import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
)
from tests.k8s.harness import ApiServer
from tests.k8s.objects import DRIVER
from tests.k8s.stack import StartStack, stack_factory
from tests.k8s.workload import allocate, claim_uid, create_pod, example_claim
from tests.waiting import until

#: Generous: the whole stack on a loaded 2-core machine.
WAIT_S = 60.0
Report = dict[str, tuple[str, str]]


@pytest.fixture
def stack() -> Iterator[StartStack]:
    yield from stack_factory()


@dataclass
class Watch:
    """One ``NodeWatchResources`` stream as kubelet holds it; each report as device name ->
    (health, message), collected as they arrive."""

    call: Any
    pool: str
    reports: list[Report] = field(default_factory=list)
    ended: grpc.StatusCode | None = None

    async def read(self) -> None:
        try:
            async for answer in self.call:
                assert {d.device.pool_name for d in answer.devices} <= {self.pool}
                assert all(d.health_check_timeout_seconds == TIMEOUT_S for d in answer.devices)
                self.reports.append({d.device.device_name: (
                    type(answer).DESCRIPTOR.file.enum_types_by_name["HealthStatus"]
                    .values_by_number[d.health].name, d.message) for d in answer.devices})
        except grpc.aio.AioRpcError as err:
            self.ended = err.code()
            return
        self.ended = await self.call.code()

    async def shows(self, want: Any, what: str) -> Report:
        """The first report from now on for which ``want(report)`` holds."""
        seen = len(self.reports)

        def check() -> list[Report]:  # a list: an empty report is one too
            later = self.reports[max(seen - 1, 0):]
            found = [r for r in later if want(r)][:1]
            if not found and self.ended is not None:
                raise AssertionError(f"the stream ended ({self.ended}) before {what}; "
                                     f"reports: {self.reports}")
            return found

        [found] = await until(check, what, WAIT_S)
        return found


def open_watch(channel: grpc.aio.Channel, version: str, pool: str,
               tasks: list[asyncio.Task[None]]) -> Watch:
    stub, pb2 = (dra_health_v1_pb2_grpc.DRAResourceHealthStub(channel), dra_health_v1_pb2) \
        if version == "v1" else (dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel),
                                 dra_health_v1alpha1_pb2)
    watch = Watch(stub.NodeWatchResources(pb2.NodeWatchResourcesRequest()), pool)
    tasks.append(asyncio.create_task(watch.read()))
    return watch


async def test_the_stream_reports_each_prepared_device_and_every_change(
        kube_apiserver: ApiServer, stack: StartStack) -> None:
    """A stream answers at once (nothing prepared: an empty report); the device kubelet
    prepares shows Healthy, on every open stream of both versions; XID 48 on its GPU turns
    it Unhealthy with the taint as the message, a reset back to Healthy, and an application
    XID (31, an informational taint) leaves it Healthy with that taint named; after
    unprepare it is no longer reported; the plugin's stop ends every stream with OK."""
    node = "hs-plugin"
    running = stack(kube_apiserver, "dgx-h100", node=node, kubelet=False)
    running.wait_slices()
    create_pod(running, "hs", example_claim("full-gpu.yaml", "hs"))
    answer = await asyncio.to_thread(allocate, running, "hs")
    assert answer.allocated, answer.reason
    [device] = answer.devices()
    gpu = device.split("-")[1]
    claim = dra_v1_pb2.Claim(namespace="default", name="hs", uid=claim_uid(running, "hs"))

    tasks: list[asyncio.Task[None]] = []
    channel = grpc.aio.insecure_channel(f"unix://{running.plugins_dir / DRIVER / 'dra.sock'}")
    try:
        first = open_watch(channel, "v1", node, tasks)
        assert await first.shows(lambda r: r == {}, "an empty first report") == {}

        dra = dra_v1_pb2_grpc.DRAPluginStub(channel)
        prepared = await dra.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=WAIT_S)
        assert prepared.claims[claim.uid].error == "", prepared
        healthy = await first.shows(lambda r: device in r, f"{device} reported")
        assert healthy == {device: ("HEALTHY", "")}, healthy
        second = open_watch(channel, "v1alpha1", node, tasks)
        assert await second.shows(lambda r: r == healthy, "the same report on v1alpha1")

        assert running.agent.request("POST", "/v1/sim/xid",
                                     {"gpu": gpu, "xid": 48}).status == 202
        unhealthy = {device: ("UNHEALTHY", f"{DRIVER}/xid=48:NoSchedule")}
        for watch in (first, second):
            await watch.shows(lambda r: r == unhealthy, f"{device} unhealthy")

        assert running.agent.request("POST", "/v1/sim/reset", {"gpu": gpu}).status == 204
        for watch in (first, second):
            await watch.shows(lambda r: r == {device: ("HEALTHY", "")}, f"{device} healthy")

        assert running.agent.request("POST", "/v1/sim/xid",
                                     {"gpu": gpu, "xid": 31}).status == 202
        informational = {device: ("HEALTHY", f"{DRIVER}/xid=31:None")}
        for watch in (first, second):
            await watch.shows(lambda r: r == informational, f"{device} informational")

        done = await dra.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=WAIT_S)
        assert done.claims[claim.uid].error == "", done
        for watch in (first, second):
            await watch.shows(lambda r: r == {}, f"{device} no longer reported")

        assert await asyncio.to_thread(running.plugin.stop, signal.SIGTERM) == 0
        await until(lambda: first.ended is not None and second.ended is not None,
                    "both streams to end", WAIT_S)
        assert (first.ended, second.ended) == (grpc.StatusCode.OK, grpc.StatusCode.OK), \
            running.plugin.log()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await channel.close()
