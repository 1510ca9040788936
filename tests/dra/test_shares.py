"""Shares (``--gpu-shares``, DRA consumable capacity): which devices a node publishes as
shareable, the memory capacity and request policy they carry, and the API server's rules for
request policies in every Kubernetes version the agent supports."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.device_names import shareable_mib
from agent.dra.resource_slices import KUBERNETES_VERSIONS, GpuFacts, RenderOptions, render
from agent.dra.rules import check

from .conftest import MakeEnv
from .test_render import base, devices, instance, mig_on, with_facts

Json = dict[str, Any]


def shares(kubernetes: tuple[int, int] = (1, 35), *, on: bool = True) -> RenderOptions:
    return RenderOptions(driver="gpu.nodeagent.dev", node_name="node-1",
                         kubernetes=kubernetes, gpu_shares=on)


def policy(gib: int) -> Json:
    """The memory capacity of a shareable GPU of ``gib`` whole GiB."""
    return {"value": f"{gib}Gi", "requestPolicy": {
        "default": f"{gib}Gi", "validRange": {"min": "1Gi", "max": f"{gib}Gi", "step": "1Gi"}}}


@pytest.mark.parametrize(("total_mib", "expected"), [
    (46068, 45056),   # L40S: 44 GiB and 1,012 MiB left over
    (81559, 80896),   # H100 80GB HBM3
    (40960, 40960),   # a whole number of GiB stays
    (1023, 0),
    (0, 0),
    (-1, 0),
])
def test_shareable_memory_is_the_total_rounded_down_to_whole_gib(total_mib: int,
                                                                expected: int) -> None:
    """shareable_mib is the total in MiB rounded down to a whole GiB, never negative."""
    assert shareable_mib(total_mib) == expected


async def test_every_l40s_is_shareable_in_gib_steps_of_its_whole_memory(
        make_env: MakeEnv) -> None:
    """With shares on, each L40S (46,068 MiB) allows multiple allocations and offers 44 GiB:
    a request without memory takes all of it, others 1 GiB steps from 1 GiB to 44 GiB; each
    carries the attribute shareable: true."""
    facts, driver = await base(make_env, "l40s")
    published = devices(render(facts, driver, shares()))
    assert [d["name"] for d in published] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    for device in published:
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"] == {"memory": policy(44)}
        # What DeviceClass share.nodeagent.dev selects on (CEL sees the field above only
        # where consumable capacity is on).
        assert device["attributes"]["shareable"] == {"bool": True}


async def test_without_the_flag_nothing_is_shareable(make_env: MakeEnv) -> None:
    """Shares off: no device allows multiple allocations and memory is the exact total with
    no request policy."""
    facts, driver = await base(make_env, "l40s")
    for device in devices(render(facts, driver, shares(on=False))):
        assert "allowMultipleAllocations" not in device
        assert "shareable" not in device["attributes"]
        assert device["capacity"] == {"memory": {"value": "46068Mi"}}


def _tiny(facts: GpuFacts, memory_mib: int) -> GpuFacts:
    static = dataclasses.replace(facts.gpu.static, memory_total_mib=memory_mib)
    return with_facts(facts, dataclasses.replace(facts.gpu, static=static))


# (case, preset, change of GPU 0's facts, GPU 0's devices: name -> shareable)
CASES = [
    ("a MIG-capable GPU with MIG off is shared whole", "dgx-h100", lambda f: f,
     {"gpu-0": True}),
    ("a GPU in MIG mode publishes its MIG devices, each exclusive", "dgx-h100",
     lambda f: with_facts(f, mig_on(f.gpu, instance(f.gpu, "3g.40gb", 4))),
     {"gpu-0-mig-3g40gb-9-4": False}),
    ("a GPU of 1.9 GiB has no two steps: exclusive", "l40s", lambda f: _tiny(f, 1950),
     {"gpu-0": False}),
    ("a GPU of exactly 2 GiB: shares of 1 or 2 GiB", "l40s", lambda f: _tiny(f, 2048),
     {"gpu-0": True}),
]


@pytest.mark.parametrize(("case", "preset", "change", "expected"), CASES,
                         ids=[c[0] for c in CASES])
async def test_what_is_shareable(make_env: MakeEnv, case: str, preset: str, change: Any,
                                 expected: dict[str, bool]) -> None:
    """Only full GPUs with MIG off and at least two GiB are shareable; their slices pass
    every supported version's rules; the other GPUs of the node are untouched."""
    facts, driver = await base(make_env, preset)
    changed = [change(facts[0]), *facts[1:]]
    slices = render(changed, driver, shares())
    gpu0 = {d["name"]: d for d in devices(slices)
            if d["name"] == "gpu-0" or d["name"].startswith("gpu-0-")}
    assert {name: d.get("allowMultipleAllocations", False) for name, d in gpu0.items()} \
        == expected
    for device in gpu0.values():
        has_policy = "requestPolicy" in device["capacity"]["memory"]
        assert has_policy == device.get("allowMultipleAllocations", False)
    assert next(d for d in devices(slices) if d["name"] == "gpu-1")[
        "allowMultipleAllocations"] is True
    for version in KUBERNETES_VERSIONS:
        assert check(render(changed, driver, shares(version)), version) == []


def _pool(capacity: Json, *, shared: Any = True) -> list[Json]:
    device: Json = {"name": "gpu-0", "attributes": {"uuid": {"string": "x"}},
                    "capacity": {"memory": capacity}}
    if shared is not None:
        device["allowMultipleAllocations"] = shared
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": "n-00000"},
             "spec": {"driver": "gpu.nodeagent.dev", "nodeName": "n", "devices": [device],
                      "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1}}}]


def _range(default: str | None, low: str | None = "1Gi", high: str | None = "44Gi",
           step: str | None = "1Gi", value: str = "44Gi") -> Json:
    span = {k: v for k, v in (("min", low), ("max", high), ("step", step)) if v is not None}
    body: Json = {"validRange": span}
    if default is not None:
        body["default"] = default
    return {"value": value, "requestPolicy": body}


# (what, pool, a needle of the problem or None for accepted)
POLICIES: list[tuple[str, list[Json], str | None]] = [
    ("the agent's policy", _pool(policy(44)), None),
    ("a policy without allowMultipleAllocations", _pool(policy(44), shared=None),
     "allowMultipleAllocations must be true"),
    ("a policy with allowMultipleAllocations false", _pool(policy(44), shared=False),
     "allowMultipleAllocations must be true"),
    ("shareable without a policy (unlimited)", _pool({"value": "44Gi"}), None),
    ("no default", _pool(_range(None)), "default: required"),
    ("no min", _pool(_range("44Gi", low=None)), "validRange.min: required"),
    ("min above the capacity", _pool(_range("45Gi", low="45Gi", high=None, step=None)),
     "above the capacity"),
    ("max above the capacity", _pool(_range("44Gi", high="45Gi")), "above the capacity"),
    ("default above max", _pool(_range("44Gi", high="40Gi")), "above max"),
    ("default below min", _pool(_range("512Mi")), "below min"),
    ("default off the steps", _pool(_range("1536Mi")), "whole number of steps"),
    ("max off the steps from min", _pool(_range("1Gi", low="1Gi", high="2560Mi",
                                                step="1Gi", value="3Gi")),
     "whole number of steps"),
    ("one step beyond the capacity", _pool(_range("1Gi", low="1Gi", high="1Gi",
                                                  value="1Gi")), "min + step"),
    ("both validValues and validRange",
     _pool({"value": "44Gi", "requestPolicy": {"default": "1Gi", "validValues": ["1Gi"],
                                               "validRange": {"min": "1Gi"}}}),
     "cannot both"),
    ("valid values with the default",
     _pool({"value": "44Gi", "requestPolicy": {"default": "4Gi",
                                               "validValues": ["1Gi", "4Gi", "44Gi"]}}), None),
    ("valid values out of order",
     _pool({"value": "44Gi", "requestPolicy": {"default": "4Gi",
                                               "validValues": ["4Gi", "1Gi"]}}),
     "ascending"),
    ("valid values without the default",
     _pool({"value": "44Gi", "requestPolicy": {"default": "2Gi",
                                               "validValues": ["1Gi", "4Gi"]}}),
     "not among them"),
    ("eleven valid values",
     _pool({"value": "44Gi", "requestPolicy": {
         "default": "1Gi", "validValues": [f"{i}Gi" for i in range(1, 12)]}}), "at most 10"),
]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("what", "pool", "needle"), POLICIES, ids=[p[0] for p in POLICIES])
def test_request_policy_rules(version: tuple[int, int], what: str, pool: list[Json],
                              needle: str | None) -> None:
    """A capacity's request policy is checked as kube-apiserver's validation does, the same
    in 1.34 to 1.37 (the fields exist in all of them, behind DRAConsumableCapacity)."""
    problems = check(pool, version)
    if needle is None:
        assert problems == []
    else:
        assert any(needle in p for p in problems), problems
