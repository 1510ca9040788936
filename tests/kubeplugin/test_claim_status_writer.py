"""The claim device status writer (agent/kubeplugin/claim_status.py) against a real
kube-apiserver, fed through the one health view the plugin has (DeviceHealthView) with the
agent's slices as its contract renders them (taints on devices): the Healthy condition
follows the taints, Ready and the times of unchanged conditions stay, only the claims whose
devices changed are written again, a write the server cannot take is retried and counted,
and unprepare removes the entries."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from agent.kubeplugin.claim_status import ClaimStatusWriter, PreparedClaim, StatusDevice
from agent.kubeplugin.claims import KubeletClaim
from agent.kubeplugin.device_health import DeviceHealthView
from agent.kubeplugin.kube import KubeClient
from tests.k8s.harness import ApiServer
from tests.k8s.link import ApiServerLink
from tests.waiting import until

Json = dict[str, Any]
DRIVER = "gpu.nodeagent.dev"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
XID_48 = {"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule",
          "timeAdded": "2026-12-02T16:40:01Z"}
XID_31 = {"key": f"{DRIVER}/xid", "value": "31", "effect": "None",
          "timeAdded": "2026-12-02T16:40:01Z"}


def agent_slices(node: str, taints: dict[str, list[Json]]) -> list[Json]:
    """The agent's slices for ``node``: gpu-0 and gpu-1, with ``taints`` by device."""
    return [{"spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node},
                      "devices": [{"name": n, **({"taints": taints[n]} if taints.get(n) else {})}
                                  for n in ("gpu-0", "gpu-1")]}}]


def allocated_claim(server: ApiServer, name: str, node: str, device: str) -> Json:
    status, claim = server.request("POST", CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nodeagent.dev"}}]}}})
    assert status == 201, claim
    claim["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]}}}
    status, claim = server.request("PUT", f"{CLAIMS}/{name}/status", claim)
    assert status == 200, claim
    return dict(claim)


def prepared(claim: Json, device: str) -> PreparedClaim:
    return PreparedClaim("default", claim["metadata"]["name"], claim["metadata"]["uid"],
                         (StatusDevice(device, None, {"uuid": f"GPU-{device}"}),))


class Clock:
    """The writer's wall clock, moved by the test (condition times are whole seconds)."""

    def __init__(self) -> None:
        self.now = 1_796_229_601.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def writing(kube: KubeClient, health: DeviceHealthView, node: str,
                  clock: Clock) -> AsyncIterator[tuple[ClaimStatusWriter, CollectorRegistry]]:
    registry = CollectorRegistry()
    writer = ClaimStatusWriter(kube, health, driver=DRIVER, pool=node, registry=registry,
                               clock=clock)
    task = asyncio.create_task(writer.run())
    try:
        yield writer, registry
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def conditions(server: ApiServer, name: str) -> dict[str, Json] | None:
    """The Healthy/Ready conditions of the claim's one entry of this driver (None: none)."""
    status, stored = server.request("GET", f"{CLAIMS}/{name}")
    assert status == 200, stored
    found = [d for d in (stored.get("status") or {}).get("devices") or []
             if d["driver"] == DRIVER]
    if not found:
        return None
    [entry] = found
    return {c["type"]: c for c in entry["conditions"]}


async def eventually(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return await asyncio.to_thread(check)
    await until(holds, what, timeout_s=30)


def health_is(server: ApiServer, name: str, status: str, reason: str) -> Callable[[], bool]:
    def check() -> bool:
        found = conditions(server, name)
        return found is not None and (found["Healthy"]["status"],
                                      found["Healthy"]["reason"]) == (status, reason)
    return check


async def test_the_health_condition_follows_the_devices_taints(
        kube_apiserver: ApiServer) -> None:
    """Two claims on gpu-0 and gpu-1: a NoSchedule XID taint on gpu-0 turns its claim's
    Healthy False naming the taint, with a new transition time, Ready untouched, and the
    other claim not written again; an informational taint alone is healthy; the agent gone
    is Unknown; unprepare removes the entry."""
    node = "status-writer"
    server = kube_apiserver
    sick, fine = (allocated_claim(server, f"w-{d}", node, d) for d in ("gpu-0", "gpu-1"))
    health = DeviceHealthView()
    await health.update(agent_slices(node, {}))
    clock = Clock()
    kube = await KubeClient.from_environment(server.kubeconfig)
    try:
        async with writing(kube, health, node, clock) as (writer, registry):
            def written() -> float:
                return registry.get_sample_value("gpu_agent_plugin_claim_status_writes_total",
                                                 {"result": "written"}) or 0.0

            writer.prepared(prepared(sick, "gpu-0"))
            writer.prepared(prepared(fine, "gpu-1"))
            for claim in (sick, fine):
                await eventually(health_is(server, claim["metadata"]["name"], "True",
                                           "NoTaints"), "healthy at first")
            await until(lambda: written() == 2, "both written", 30)
            before = conditions(server, "w-gpu-0")
            assert before is not None

            clock.now += 60
            await health.update(agent_slices(node, {"gpu-0": [XID_48, XID_31]}))
            await eventually(health_is(server, "w-gpu-0", "False", "Tainted"), "tainted")
            after = conditions(server, "w-gpu-0")
            assert after is not None
            assert after["Healthy"]["message"] == (f"{DRIVER}/xid=48:NoSchedule, "
                                                   f"{DRIVER}/xid=31:None")
            assert after["Healthy"]["lastTransitionTime"] == "2026-12-02T16:41:01Z"
            assert after["Ready"] == before["Ready"]
            await until(lambda: registry.get_sample_value(
                "gpu_agent_plugin_claim_status_pending") == 0, "nothing pending", 30)
            assert written() == 3  # the other claim's devices did not change

            clock.now += 60
            await health.update(agent_slices(node, {"gpu-0": [XID_31]}))
            await eventually(health_is(server, "w-gpu-0", "True", "InformationalTaints"),
                             "informational only")
            await health.update(None)
            await eventually(health_is(server, "w-gpu-0", "Unknown", "HealthUnknown"),
                             "agent gone")
            await eventually(health_is(server, "w-gpu-1", "Unknown", "HealthUnknown"),
                             "agent gone")

            writer.unprepared(KubeletClaim("default", sick["metadata"]["uid"], "w-gpu-0"))
            await eventually(lambda: conditions(server, "w-gpu-0") is None, "removed")
            assert conditions(server, "w-gpu-1") is not None
            assert writer.problem is None
    finally:
        await kube.close()


async def test_a_write_that_fails_is_retried_and_counted(kube_apiserver: ApiServer) -> None:
    """With the API server unreachable the claim's status write fails: it is counted as
    retried, the writer's problem (shown by /readyz) says so, and once the server is back
    the status is written without anything else asking for it."""
    node = "status-retry"
    server = kube_apiserver
    claim = allocated_claim(server, "w-retry", node, "gpu-0")
    health = DeviceHealthView()
    await health.update(agent_slices(node, {}))
    link = ApiServerLink(server.url).start()
    with tempfile.TemporaryDirectory() as scratch:
        admin = Path(scratch) / "admin.kubeconfig"  # the harness writes YAML; the link JSON
        admin.write_text(json.dumps(yaml.safe_load(server.kubeconfig.read_text())))
        kube = await KubeClient.from_environment(
            link.kubeconfig(admin, Path(scratch) / "link.kubeconfig"))
        try:
            async with writing(kube, health, node, Clock()) as (writer, registry):
                await asyncio.to_thread(link.cut)
                writer.prepared(prepared(claim, "gpu-0"))
                await until(lambda: (registry.get_sample_value(
                    "gpu_agent_plugin_claim_status_writes_total", {"result": "retried"})
                    or 0) >= 2, "retries", 30)
                assert writer.problem is not None and "retrying" in writer.problem
                assert registry.get_sample_value("gpu_agent_plugin_claim_status_pending") == 1
                await asyncio.to_thread(link.restore)
                await eventually(health_is(server, "w-retry", "True", "NoTaints"), "written")
                await until(lambda: writer.problem is None, "no problem left", 30)
        finally:
            await kube.close()
            await asyncio.to_thread(link.close)
