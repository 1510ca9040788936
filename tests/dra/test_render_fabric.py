"""The NVLink fabric in the slices: each GPU's devices carry ``fabricClique`` from its fabric as
last read (only while it is usable) and its fabric faults' taints, so a GPU whose registration
is not done is not offered for a domain; the other GPUs are untouched. Pure renderer first
(facts in, slices out), then the service over a simulated GB200 tray whose fabric changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.dra.resource_slices import GpuFacts, RenderOptions, render
from agent.dra.rules import check
from agent.gpu.types import Fabric
from agent.health.fabric import fabric_faults

from .conftest import MakeEnv
from .test_render import base, devices

D = "gpu.nodeagent.dev"
CLUSTER = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"
ZERO = "00000000-0000-0000-0000-000000000000"
Json = dict[str, Any]


def opts(kubernetes: tuple[int, int], *, dynamic: bool) -> RenderOptions:
    return RenderOptions(driver=D, node_name="node-1", kubernetes=kubernetes,
                         dynamic_mig=dynamic)


def of_gpu(slices: list[Json], minor: int) -> list[Json]:
    own = f"gpu-{minor}"
    return [d for d in devices(slices) if d["name"] == own or d["name"].startswith(own + "-")]


def seen(device: Json) -> tuple[str | None, list[tuple[str, str | None, str]]]:
    """(its fabricClique, its taints as (key, value, effect))."""
    clique = device["attributes"].get("fabricClique")
    return (clique["string"] if clique else None,
            [(t["key"], t.get("value"), t["effect"]) for t in device.get("taints") or []])


def with_fabric(facts: GpuFacts, fabric: Fabric) -> GpuFacts:
    """The GPU as the service would hand it over: the fabric as read, and its faults."""
    return dataclasses.replace(facts, gpu=dataclasses.replace(facts.gpu, fabric=fabric),
                               faults=fabric_faults(fabric, seen={}, now=1_796_000_000.0))


# (GPU 1's fabric, what each of its devices shows: (fabricClique, taints))
TABLE = [
    (Fabric(CLUSTER, 7, 3, 0), (f"{CLUSTER}.7", [])),
    (Fabric(CLUSTER, 8, 3, 0), (f"{CLUSTER}.8", [])),  # the clique as it is now
    (Fabric(ZERO, 0, 2, 0), (None, [(f"{D}/fabric", "in_progress", "NoSchedule")])),
    (Fabric(ZERO, 0, 1, 0), (None, [(f"{D}/fabric", "not_started", "NoSchedule")])),
    (Fabric(ZERO, 0, 3, 23, status_name="NVML_ERROR_INSUFFICIENT_RESOURCES"),
     (None, [(f"{D}/fabric", "NVML_ERROR_INSUFFICIENT_RESOURCES", "NoSchedule")])),
    (Fabric(CLUSTER, 7, 3, 0, health_mask=1, health=("degraded_bandwidth",)),
     (f"{CLUSTER}.7", [(f"{D}/fabric-health", "degraded_bandwidth", "None")])),
]


@pytest.mark.parametrize(("fabric", "expected"), TABLE,
                         ids=[f"{f.state_name}-{f.status}-{f.clique_id}-{len(f.health)}"
                              for f, _ in TABLE])
@pytest.mark.parametrize("dynamic", [False, True])
async def test_a_gpus_devices_follow_its_fabric(make_env: MakeEnv, fabric: Fabric,
                                                expected: tuple[Any, ...], dynamic: bool) -> None:
    facts, driver = await base(make_env, "gb200-nvl72")
    assert all(f.gpu.fabric and f.gpu.fabric.clique for f in facts)
    kubernetes = (1, 37)
    before = render(facts, driver, opts(kubernetes, dynamic=dynamic))
    changed = [facts[0], with_fabric(facts[1], fabric), *facts[2:]]
    after = render(changed, driver, opts(kubernetes, dynamic=dynamic))
    assert check(after, kubernetes) == []
    assert of_gpu(after, 1) and all(seen(d) == expected for d in of_gpu(after, 1))
    for minor in (0, 2, 3):
        assert of_gpu(after, minor) == of_gpu(before, minor)


def gpu_pool(items: list[Json]) -> list[Json]:
    """The GPUs' slices of an answer (the compute-domain slot aside: test_domain_slot.py)."""
    return [s for s in items if "nodeName" in s["spec"]]


def slots(items: list[Json]) -> list[Json]:
    return [s for s in items if "nodeSelector" in s["spec"]]


async def test_the_service_publishes_the_fabric_as_it_is_now(make_env: MakeEnv) -> None:
    """A fabric that changes behind the agent: the next render from a fresh inventory read
    drops GPU 1's clique and taints it, and withdraws the node's compute-domain slot; back to
    completed, its devices and the slot are as before."""
    env = await make_env("gb200-nvl72")
    uuid = env.node.gpu_uuids()[1]
    first = (await env.resource_slices.render((1, 37))).items
    clique = seen(of_gpu(first, 0)[0])[0]
    assert clique and [seen(d) for d in devices(gpu_pool(first))] == [(clique, [])] * 4
    assert [seen(d) for d in devices(slots(first))] == [(clique, [])]

    env.node.set_fabric(uuid, "in-progress")
    stuck = (await env.resource_slices.render((1, 37))).items
    assert [seen(d) for d in devices(stuck)] == [
        (clique, []), (None, [(f"{D}/fabric", "in_progress", "NoSchedule")]),
        (clique, []), (clique, [])]
    assert slots(stuck) == []
    gpu = env.inventory.gpus[1]
    assert env.ledger.condition(gpu) and "in_progress" in env.ledger.condition(gpu)[0]

    env.node.set_fabric(uuid, "completed")
    back = (await env.resource_slices.render((1, 37))).items
    assert devices(back) == devices(first) and slots(back) == slots(first)
    assert env.ledger.condition(env.inventory.gpus[1]) == ()
