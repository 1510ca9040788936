"""A node's compute-domain slot: offered (one device in a slice of its own, selected by the
clique's node label) exactly while every GPU of the node is registered in one NVLink clique
with no blocking fabric fault. Pure renderer over a simulated GB200 tray's GPUs first, then
the agent's /v1/resourceslices answer."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.device_names import slot_slice_name
from agent.dra.domain_slot import clique_label_value, node_clique, render_slot
from agent.dra.resource_slices import GpuFacts
from agent.dra.rules import check
from agent.gpu.types import Fabric
from agent.health.fabric import fabric_faults

from .conftest import MakeEnv
from .test_render import base

D = "gpu.nodeagent.dev"
A = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"
B = "1d2e3f40-0b6d-4c1e-8f43-6a2d51f0c7e2"
ZERO = "00000000-0000-0000-0000-000000000000"
Json = dict[str, Any]

COMPLETED = Fabric(A, 7, 3, 0)
IN_PROGRESS = Fabric(ZERO, 0, 2, 0)
NOT_STARTED = Fabric(ZERO, 0, 1, 0)
FAILED = Fabric(ZERO, 0, 3, 23, status_name="NVML_ERROR_INSUFFICIENT_RESOURCES")
DEGRADED = Fabric(A, 7, 3, 0, health_mask=1, health=("degraded_bandwidth",))
NO_CLIQUE = Fabric(ZERO, 0, 3, 0)  # registered, in no multi-node domain


def with_fabric(facts: GpuFacts, fabric: Fabric | None) -> GpuFacts:
    """The GPU as the service hands it over: the fabric as read, and its faults."""
    return dataclasses.replace(facts, gpu=dataclasses.replace(facts.gpu, fabric=fabric),
                               faults=fabric_faults(fabric, seen={}, now=1_796_000_000.0))


# (the four GPUs' fabrics, the clique the node offers a slot in: None for no slot)
TABLE = [
    ("all completed", [COMPLETED] * 4, f"{A}.7"),
    ("one in progress", [COMPLETED, IN_PROGRESS, COMPLETED, COMPLETED], None),
    ("one not started", [COMPLETED, COMPLETED, COMPLETED, NOT_STARTED], None),
    ("one failed", [FAILED, COMPLETED, COMPLETED, COMPLETED], None),
    ("one degraded (informational)", [COMPLETED, DEGRADED, COMPLETED, COMPLETED], f"{A}.7"),
    ("one without a fabric", [COMPLETED, None, COMPLETED, COMPLETED], None),
    ("none has a fabric", [None] * 4, None),
    ("registered, no clique", [NO_CLIQUE] * 4, None),
    ("two clique ids", [COMPLETED, COMPLETED, Fabric(A, 8, 3, 0), COMPLETED], None),
    ("two clusters", [COMPLETED, COMPLETED, COMPLETED, Fabric(B, 7, 3, 0)], None),
    ("all in another clique", [Fabric(B, 2, 3, 0)] * 4, f"{B}.2"),
]


@pytest.mark.parametrize(("fabrics", "clique"), [(f, c) for _, f, c in TABLE],
                         ids=[t[0] for t in TABLE])
async def test_a_slot_exactly_while_every_gpu_is_in_one_clique(
        make_env: MakeEnv, fabrics: list[Fabric | None], clique: str | None) -> None:
    facts, _ = await base(make_env, "gb200-nvl72")
    assert len(facts) == 4
    gpus = [with_fabric(f, fabric) for f, fabric in zip(facts, fabrics, strict=True)]
    assert node_clique(gpus) == clique
    slot = render_slot(gpus, driver=D, node_name="tray-03")
    if clique is None:
        assert slot is None
        return
    assert slot is not None
    assert check([slot], (1, 34)) == [] and check([slot], (1, 37)) == []
    assert slot["metadata"] == {"name": "tray-03-compute-domain"}
    spec = slot["spec"]
    assert "nodeName" not in spec
    assert spec["driver"] == D
    assert spec["pool"] == {"name": "tray-03/compute-domain", "generation": 0,
                            "resourceSliceCount": 1}
    assert spec["nodeSelector"] == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": f"{D}/fabric-clique", "operator": "In", "values": [clique]}]}]}
    assert spec["devices"] == [{"name": "slot", "attributes": {
        "type": {"string": "compute-domain-slot"}, "fabricClique": {"string": clique}}}]
    # The same value the GPUs' devices carry, so one matchAttribute fits both.
    assert all(g.gpu.fabric and g.gpu.fabric.clique == clique for g in gpus)


async def test_a_lost_gpu_withdraws_the_slot(make_env: MakeEnv) -> None:
    """A GPU the agent lost (no minor) cannot serve a domain pod: the node offers none."""
    facts, _ = await base(make_env, "gb200-nvl72")
    lost = dataclasses.replace(facts[2], gpu=dataclasses.replace(
        facts[2].gpu, static=dataclasses.replace(facts[2].gpu.static, minor=-1)))
    assert node_clique(facts) is not None
    assert node_clique([facts[0], facts[1], lost, facts[3]]) is None
    assert node_clique([]) is None


@pytest.mark.parametrize(("clique", "value"), [
    (f"{A}.7", f"{A}.7"),
    (f"{A}.4294967295", f"{A}.4294967295"),
    ("x" * 63, "x" * 63),
])
def test_a_clique_that_is_a_label_value_is_its_own_label(clique: str, value: str) -> None:
    assert clique_label_value(clique) == value


@pytest.mark.parametrize("clique", ["x" * 64, "a/b.1", "-a.1", "a.1-", "é.1"])
def test_a_clique_that_is_not_a_label_value_is_labelled_by_its_digest(clique: str) -> None:
    value = clique_label_value(clique)
    assert value.startswith("clique-") and len(value) <= 63 and value.isascii()
    assert value == clique_label_value(clique) and value != clique_label_value(clique + "x")


@pytest.mark.parametrize(("node", "name"), [
    ("tray-03", "tray-03-compute-domain"),
    ("Tray_03", "tray-03-compute-domain"),
])
def test_slot_slice_names(node: str, name: str) -> None:
    assert slot_slice_name(node) == name


def test_a_long_node_name_is_cut_and_hashed() -> None:
    long_a, long_b = "n" * 250 + "a", "n" * 250 + "b"
    a, b = slot_slice_name(long_a), slot_slice_name(long_b)
    assert len(a) <= 253 and len(b) <= 253 and a != b
    assert a.endswith("-compute-domain") and b.endswith("-compute-domain")


async def test_the_agent_answers_its_slot_after_the_gpus_pool(make_env: MakeEnv) -> None:
    """/v1/resourceslices of a GB200 tray: the GPUs' pool by node name, then the slot; an
    H100 node (no fabric) has no slot."""
    env = await make_env("gb200-nvl72", name="slot-agent")
    items = await env.resource_slices.of_version((1, 37))
    assert [s["spec"].get("nodeName") for s in items[:-1]] == [env.resource_slices.node_name] * (
        len(items) - 1)
    slot = items[-1]
    assert slot["spec"]["pool"]["name"] == env.resource_slices.node_name + "/compute-domain"
    clique = slot["spec"]["devices"][0]["attributes"]["fabricClique"]["string"]
    gpus = [d for s in items[:-1] for d in s["spec"]["devices"]]
    assert gpus and all(d["attributes"]["fabricClique"]["string"] == clique for d in gpus)
    h100 = await make_env("dgx-h100", name="slot-h100")
    assert all("nodeName" in s["spec"] for s in await h100.resource_slices.of_version((1, 37)))
