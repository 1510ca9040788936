"""The scheduler's own allocator (k8s.io/dynamic-resource-allocation/structured, oldest and
newest supported Kubernetes) placing claims on the slices a real agent publishes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import DRA_GATES
from tests.k8s.harness import SLICE_RULES, VERSIONS, allocate
from tests.k8s.objects import (
    MIG_CLASS,
    attr,
    claim,
    classes,
    devices_of,
    request,
    string_attribute,
    with_allocation,
)
from tests.k8s.published import gpu_uuid, set_mig, slices_of
from tests.waiting import wait_for

NODE = "gpu-node-1"


@dataclass(frozen=True)
class Step:
    """One claim placed after the previous steps' allocations: what it asks for and the
    devices it must get (None: the allocator must refuse it)."""

    what: str
    requests: tuple[dict[str, Any], ...]
    expect: tuple[str, ...] | None
    match_attribute: str | None = None


class Node:
    """A simulated agent's slices, and the claims allocated on them so far."""

    def __init__(self, version: str, slices: list[dict[str, Any]]) -> None:
        self.version = version
        self.slices = slices
        self.allocated: list[dict[str, Any]] = []

    def place(self, step: Step) -> tuple[str, ...] | None:
        """Allocate the step's claim; an allocation is kept for the steps after it."""
        wanted = claim(f"c{len(self.allocated)}", *step.requests,
                       match_attribute=step.match_attribute)
        answer = allocate(self.version, node=NODE, slices=self.slices, classes=classes(),
                          claims=[wanted], allocated=self.allocated,
                          feature_gates=DRA_GATES[self.version])
        if not answer.allocated:
            return None
        self.allocated.append(with_allocation(wanted, answer.results[0]["allocation"]))
        return tuple(answer.devices())


def run_steps(node: Node, steps: list[Step]) -> None:
    for step in steps:
        assert node.place(step) == step.expect, step.what


def profile(name: str, parent: str) -> tuple[str, ...]:
    return (f'{attr("profile")} == "{name}"', f'{attr("parentUUID")} == "{parent}"')


@pytest.mark.parametrize("version", VERSIONS)
def test_full_gpus_first_fit_then_refused_when_all_taken(version: str,
                                                         agent_node: StartAgent) -> None:
    """Whole-GPU claims get distinct GPUs in device order until none is left, then are
    refused; a claim for one GPU's UUID gets exactly that GPU."""
    agent = agent_node("dgx-h100", node_name=NODE)
    three = gpu_uuid(agent, 3)
    node = Node(version, slices_of(agent, SLICE_RULES[version]))
    run_steps(node, [
        Step("one GPU", (request(),), ("gpu-0",)),
        Step("GPU 3 by UUID", (request(selectors=(f'{attr("uuid")} == "{three}"',)),),
             ("gpu-3",)),
        Step("GPU 3 again", (request(selectors=(f'{attr("uuid")} == "{three}"',)),), None),
        Step("six more", (request(count=6),), ("gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6",
                                                "gpu-7")),
        Step("a ninth", (request(),), None),
    ])


@pytest.mark.parametrize("version", VERSIONS)
def test_static_mig_devices_are_allocated_by_profile(version: str,
                                                     agent_node: StartAgent) -> None:
    """With GPU 0 split 3g+2g+1g+1g, MIG claims get its existing instances by profile (two
    1g.10gb, then none), and whole-GPU claims never get the MIG-mode GPU."""
    agent = agent_node("dgx-h100", node_name=NODE)
    set_mig(agent, 0, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    slices = slices_of(agent, SLICE_RULES[version])
    mig = sorted(name for name in devices_of(slices) if name.startswith("gpu-0-mig-1g10gb"))
    assert len(mig) == 2
    node = Node(version, slices)
    one_g = request(device_class_name=MIG_CLASS, selectors=(f'{attr("profile")} == "1g.10gb"',))
    run_steps(node, [
        Step("a 1g.10gb", (one_g,), (mig[0],)),
        Step("another 1g.10gb", (one_g,), (mig[1],)),
        Step("a third 1g.10gb", (one_g,), None),
        Step("eight whole GPUs", (request(count=8),), None),
        Step("seven whole GPUs", (request(count=7),), tuple(f"gpu-{i}" for i in range(1, 8))),
    ])


@pytest.mark.parametrize("version", VERSIONS)
def test_nvlink_island_constraint_on_bridged_pairs(version: str,
                                                   agent_node: StartAgent) -> None:
    """On a100-pcie-bridged (NVLink pairs 0-2, 1-3, 4-5, 6-7), matchAttribute on
    nvlinkIsland keeps a 2-GPU claim inside one pair, skips a pair with a GPU taken, and
    refuses 4 GPUs in one island, which this node does not have."""
    agent = agent_node("a100-pcie-bridged", node_name=NODE)
    node = Node(version, slices_of(agent, SLICE_RULES[version]))
    run_steps(node, [
        Step("4 in one island", (request(count=4),), None, "nvlinkIsland"),
        Step("2 in one island", (request(count=2),), ("gpu-0", "gpu-2"), "nvlinkIsland"),
        Step("GPU 1 alone", (request(selectors=(f'{attr("uuid")} == "{gpu_uuid(agent, 1)}"',)),),
             ("gpu-1",)),
        Step("2 more in one island", (request(count=2),), ("gpu-4", "gpu-5"), "nvlinkIsland"),
    ])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("preset", "expect"), [
    ("dgx-h100", ("gpu-0", "gpu-1", "gpu-2", "gpu-3")),
    ("l40s", None),
])
def test_four_gpus_in_one_island(version: str, preset: str, expect: tuple[str, ...] | None,
                                 agent_node: StartAgent) -> None:
    """4 GPUs in one NVLink island fit on an NVSwitch node and never on a node without NVLink
    (no island attribute to match)."""
    agent = agent_node(preset, node_name=NODE)
    node = Node(version, slices_of(agent, SLICE_RULES[version]))
    run_steps(node, [Step("4 in one island", (request(count=4),), expect, "nvlinkIsland")])


@pytest.mark.parametrize("version", VERSIONS)
def test_dynamic_mig_counters_keep_placements_apart(version: str,
                                                    agent_node: StartAgent) -> None:
    """With --dynamic-mig, the GPU's shared counters let the allocator book a 3g.40gb at
    each free placement and nothing that would overlap one: no 4g.40gb, no whole GPU, no
    1g.10gb once all memory slices are booked; on another GPU seven 1g.10gb fill it."""
    agent = agent_node("dgx-h100", node_name=NODE, dynamic_mig=True)
    zero, one = gpu_uuid(agent, 0), gpu_uuid(agent, 1)
    node = Node(version, slices_of(agent, SLICE_RULES[version]))

    def mig(name: str, parent: str, count: int = 1) -> tuple[dict[str, Any], ...]:
        return (request(device_class_name=MIG_CLASS, count=count,
                        selectors=profile(name, parent)),)

    whole_zero = (request(selectors=(f'{attr("uuid")} == "{zero}"',)),)
    run_steps(node, [
        Step("3g.40gb on GPU 0", mig("3g.40gb", zero), ("gpu-0-mig-3g40gb-9-0",)),
        Step("4g.40gb overlapping it", mig("4g.40gb", zero), None),
        Step("GPU 0 whole", whole_zero, None),
        Step("second 3g.40gb", mig("3g.40gb", zero), ("gpu-0-mig-3g40gb-9-4",)),
        Step("1g.10gb with no memory slice left", mig("1g.10gb", zero), None),
        Step("seven 1g.10gb on GPU 1", mig("1g.10gb", one, 7),
             tuple(f"gpu-1-mig-1g10gb-19-{i}" for i in range(7))),
        Step("a 1g.10gb+me over them", mig("1g.10gb+me", one), None),
        Step("GPU 2 whole is untouched", (request(selectors=(
            f'{attr("uuid")} == "{gpu_uuid(agent, 2)}"',)),), ("gpu-2",)),
    ])


def _wait_unpublished(agent: Any, kubernetes: str, device: str) -> list[dict[str, Any]]:
    def unpublished() -> list[dict[str, Any]] | None:
        slices = slices_of(agent, kubernetes)
        offered = devices_of(slices).get(device)
        return slices if offered is None or offered.get("taints") else None
    found: list[dict[str, Any]] = wait_for(
        unpublished, f"{device} to be withdrawn or tainted after the XID", 10, every_s=0.1)
    return found


@pytest.mark.parametrize("version", VERSIONS)
def test_nothing_allocated_from_a_gpu_after_a_critical_xid(version: str,
                                                           agent_node: StartAgent) -> None:
    """After XID 48 on GPU 3, the allocator gives no claim that GPU: not by UUID, not as one
    of eight; seven whole GPUs are still allocated from the others."""
    agent = agent_node("dgx-h100", node_name=NODE, extra=("--collect-interval", "0.2"))
    three = gpu_uuid(agent, 3)
    by_uuid = (request(selectors=(f'{attr("uuid")} == "{three}"',)),)
    before = Node(version, slices_of(agent, SLICE_RULES[version]))
    run_steps(before, [Step("GPU 3 while healthy", by_uuid, ("gpu-3",))])

    assert agent.request("POST", "/v1/sim/xid", {"gpu": three, "xid": 48}).status == 202
    after = Node(version, _wait_unpublished(agent, SLICE_RULES[version], "gpu-3"))
    run_steps(after, [
        Step("GPU 3 by UUID", by_uuid, None),
        Step("eight GPUs", (request(count=8),), None),
        Step("seven GPUs", (request(count=7),), ("gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5",
                                                  "gpu-6", "gpu-7")),
    ])
    assert string_attribute(devices_of(before.slices)["gpu-3"], "uuid") == three
