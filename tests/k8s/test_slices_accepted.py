"""The agent's ResourceSlices against a real kube-apiserver's validation and storage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from agent.dra.rules import quantity
from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import StartApiServer
from tests.k8s.harness import SLICE_RULES, VERSIONS
from tests.k8s.published import set_mig, slices_of

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass(frozen=True)
class Case:
    preset: str
    dynamic_mig: bool = False
    geometry: tuple[tuple[int, tuple[str, ...]], ...] = ()  # MIG applied first: (gpu, profiles)
    shares: bool = False  # --gpu-shares

    @property
    def id(self) -> str:
        return "-".join([self.preset, "dynamic" if self.dynamic_mig else "static",
                         *(["mig"] if self.geometry else []), *(["shares"] if self.shares
                                                                else [])])


CASES = [
    Case("dgx-h100"),
    Case("dgx-h100", geometry=((0, ("1g.10gb",) * 7), (1, ("3g.40gb", "2g.20gb", "1g.10gb")))),
    Case("dgx-h100", dynamic_mig=True),
    Case("dgx-h100", dynamic_mig=True, geometry=((2, ("3g.40gb", "1g.10gb")),)),
    Case("a100-pcie-bridged"),
    Case("a100-pcie-bridged", dynamic_mig=True),
    Case("l40s"),
    Case("l40s", dynamic_mig=True),
    Case("l40s", shares=True),
    Case("dgx-h100", geometry=((0, ("1g.10gb",) * 7),), shares=True),
]


def _semantic(value: Any) -> Any:
    """A slice spec compared as the server means it: quantities by value (the server writes
    them canonically, 81920Mi as 80Gi) and empty lists as absent (omitted on the wire)."""
    if isinstance(value, dict):
        if set(value) == {"value"} and isinstance(value["value"], str):
            return quantity(value["value"])
        return {k: _semantic(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [_semantic(v) for v in value]
    return value


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_published_slices_are_created_unchanged(version: str, case: Case,
                                                kube_apiservers: StartApiServer,
                                                agent_node: StartAgent) -> None:
    """Every slice the agent renders for a server's version is created by that real
    kube-apiserver (201) and read back with the spec the agent wrote, no field dropped."""
    server = kube_apiservers(version)
    node_name = f"{case.id}-v{version}".replace(".", "-")
    agent = agent_node(case.preset, node_name=node_name, dynamic_mig=case.dynamic_mig,
                       extra=("--gpu-shares",) if case.shares else ())
    for gpu, profiles in case.geometry:
        set_mig(agent, gpu, list(profiles))
    server.ensure_node(node_name)
    slices = slices_of(agent, SLICE_RULES[version])
    assert slices and any(s["spec"].get("devices") for s in slices)
    assert case.shares == any(d.get("allowMultipleAllocations") for s in slices
                              for d in s["spec"].get("devices") or [])
    for item in slices:
        status, created = server.request("POST", SLICES, item)
        assert status == 201, created
        status, stored = server.request("GET", f"{SLICES}/{item['metadata']['name']}")
        assert status == 200
        assert _semantic(stored["spec"]) == _semantic(item["spec"])


@pytest.mark.parametrize(("version", "gates"), [("1.34", ""),
                                                ("1.37", "DRAPartitionableDevices=false")])
def test_server_without_partitionable_gate_drops_counters_silently(
        version: str, gates: str, kube_apiservers: StartApiServer,
        agent_node: StartAgent) -> None:
    """A server whose DRAPartitionableDevices gate is off (1.34's default) still answers 201
    to dynamic-MIG slices but stores them without sharedCounters and consumesCounters: only
    reading back shows the loss (what the publisher must detect)."""
    server = kube_apiservers(version, feature_gates=gates)
    node_name = f"gate-off-v{version}".replace(".", "-")
    agent = agent_node("dgx-h100", node_name=node_name, dynamic_mig=True)
    server.ensure_node(node_name)
    sent = slices_of(agent, SLICE_RULES[version])
    assert any("sharedCounters" in s["spec"] for s in sent)
    for item in sent:
        status, stored = server.request("POST", SLICES, item)
        assert status == 201, stored
        assert "sharedCounters" not in stored["spec"]
        assert not any("consumesCounters" in d for d in stored["spec"].get("devices", []))
