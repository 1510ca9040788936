"""The renderer's taints as a table: every fault kind on every kind of device (full GPU, MIG
device, dynamic-MIG placement, share), MIG scoping, Kubernetes 1.34 (no None effect) against
1.37, NoExecute only when opted in, and the per-slice device limit once devices carry
taints. Pure: GpuFacts in, slices out, each checked by the server's rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.dra.resource_slices import (
    GpuFacts,
    RenderOptions,
    published_taints,
    render,
)
from agent.dra.rules import check, rules_for
from agent.gpu.types import DriverInfo, MigMode
from agent.health.taints import Fault, RecoveryAction, Taint

from .conftest import MakeEnv
from .test_render import base, devices, instance

D = "gpu.nodeagent.dev"
T0 = 1_796_000_000.0  # 2026-11-30T00:53:20Z
Json = dict[str, Any]


def xid(n: int, *, gi: int | None = None, ci: int | None = None, since: float = T0,
        action: RecoveryAction | None = None) -> Fault:
    return Fault("xid", f"XID {n}", since, value=str(n), gi_id=gi, ci_id=ci,
                 recovery_action=action)


LOST = Fault("gpu-lost", "GPU is lost", T0)
UNMONITORED = Fault("unmonitored", "no XID events", T0)
QUARANTINED = Fault("quarantined", "quarantined: rollback failed", T0)
DRAINED = Fault("drain", "drained: fan", T0, value="fan")
FABRIC = Fault("fabric", "NVLink fabric not registered: in_progress", T0, value="in_progress")
FABRIC_HEALTH = Fault("fabric-health", "NVLink fabric health: degraded_bandwidth", T0,
                      value="degraded_bandwidth")


def opts(kubernetes: tuple[int, int], *, dynamic: bool = False, shares: bool = False,
         no_execute: bool = False) -> RenderOptions:
    return RenderOptions(driver=D, node_name="node-1", kubernetes=kubernetes,
                         dynamic_mig=dynamic, gpu_shares=shares, no_execute=no_execute)


def taints(slices: list[Json], name: str) -> list[tuple[str, str | None, str]] | None:
    """(key, value, effect) of device ``name``'s taints; None when it is not published."""
    found = next((d for d in devices(slices) if d["name"] == name), None)
    if found is None:
        return None
    return [(t["key"], t.get("value"), t["effect"]) for t in found.get("taints") or []]


def stamped(slices: list[Json]) -> set[str]:
    return {t["timeAdded"] for d in devices(slices) for t in d.get("taints") or []}


# (fault, no_execute, what gpu-0 carries on 1.37, on 1.34)
FAULT_KINDS = [
    (xid(48), False, [(f"{D}/xid", "48", "NoSchedule")], [(f"{D}/xid", "48", "NoSchedule")]),
    (xid(31), False, [(f"{D}/xid", "31", "None")], []),
    (xid(79), False, [(f"{D}/xid", "79", "NoSchedule")], [(f"{D}/xid", "79", "NoSchedule")]),
    (xid(79), True, [(f"{D}/xid", "79", "NoExecute")], [(f"{D}/xid", "79", "NoExecute")]),
    (xid(48), True, [(f"{D}/xid", "48", "NoSchedule")], [(f"{D}/xid", "48", "NoSchedule")]),
    (xid(48, action=RecoveryAction.NONE), False, [(f"{D}/xid", "48", "None")], []),
    (xid(31, action=RecoveryAction.NODE_REBOOT), True, [(f"{D}/xid", "31", "NoExecute")],
     [(f"{D}/xid", "31", "NoExecute")]),
    (LOST, False, [(f"{D}/gpu-lost", None, "NoSchedule")],
     [(f"{D}/gpu-lost", None, "NoSchedule")]),
    (LOST, True, [(f"{D}/gpu-lost", None, "NoExecute")], [(f"{D}/gpu-lost", None, "NoExecute")]),
    (UNMONITORED, True, [(f"{D}/unmonitored", None, "None")], []),
    (QUARANTINED, True, [(f"{D}/quarantined", None, "NoSchedule")],
     [(f"{D}/quarantined", None, "NoSchedule")]),
    (DRAINED, True, [(f"{D}/drain", "fan", "NoSchedule")], [(f"{D}/drain", "fan", "NoSchedule")]),
    (FABRIC, True, [(f"{D}/fabric", "in_progress", "NoSchedule")],
     [(f"{D}/fabric", "in_progress", "NoSchedule")]),
    (FABRIC_HEALTH, False, [(f"{D}/fabric-health", "degraded_bandwidth", "None")], []),
]


@pytest.mark.parametrize(("fault", "no_execute", "v137", "v134"), FAULT_KINDS,
                         ids=[f"{f.kind}-{f.value}-{f.recovery_action}-{x}"
                              for f, x, *_ in FAULT_KINDS])
@pytest.mark.parametrize("mode", ["static", "dynamic", "shares"])
async def test_every_fault_kind_taints_the_gpu_on_every_version(
        make_env: MakeEnv, *, fault: Fault, no_execute: bool, v137: list[Any],
        v134: list[Any], mode: str) -> None:
    """A fault of GPU 0 leaves its full GPU published with the fault's taint (1.34 without
    the None effect), every other GPU untainted; the slices pass the server's rules."""
    facts, driver = await base(make_env, "dgx-h100")
    faulty = [dataclasses.replace(facts[0], faults=(fault,)), *facts[1:]]
    for kubernetes, expected in (((1, 37), v137), ((1, 34), v134)):
        options = opts(kubernetes, dynamic=mode == "dynamic", shares=mode == "shares",
                       no_execute=no_execute)
        slices = render(faulty, driver, options)
        assert check(slices, kubernetes) == []
        assert taints(slices, "gpu-0") == expected, kubernetes
        assert taints(slices, "gpu-1") == []
        assert stamped(slices) <= {"2026-11-30T00:53:20Z"}
        if mode == "dynamic":  # every placement of the GPU carries the GPU's taint
            placements = [d for d in devices(slices) if d["name"].startswith("gpu-0-mig-")]
            assert placements and all(taints(slices, d["name"]) == expected
                                      for d in placements)


def _mig(facts: GpuFacts) -> GpuFacts:
    """GPU 0 in MIG mode with two 3g instances: GI 1 at slice 0, GI 2 at slice 4."""
    one = instance(facts.gpu, "3g.40gb", 0, uuid="MIG-a")
    two = dataclasses.replace(instance(facts.gpu, "3g.40gb", 4, uuid="MIG-b"), gi_id=2)
    gpu = dataclasses.replace(facts.gpu, mig_mode=MigMode(True, True), mig_devices=(one, two))
    return dataclasses.replace(facts, gpu=gpu)


# (faults, taints of the instance at 0 (GI 1), of the instance at 4 (GI 2))
MIG_SCOPES = [
    ((xid(48),), [(f"{D}/xid", "48", "NoSchedule")], [(f"{D}/xid", "48", "NoSchedule")]),
    ((xid(48, gi=1, ci=0),), [(f"{D}/xid", "48", "NoSchedule")], []),
    ((xid(48, gi=2),), [], [(f"{D}/xid", "48", "NoSchedule")]),  # GI-wide: every CI of it
    ((xid(48, gi=1, ci=5),), [], []),  # another compute instance of GI 1
    ((xid(31), xid(48, gi=2, ci=0, since=T0 + 1)), [(f"{D}/xid", "31", "None")],
     [(f"{D}/xid", "48", "NoSchedule")]),  # one taint per key: the heavier wins
    ((LOST, xid(48, gi=1, ci=0)), [(f"{D}/gpu-lost", None, "NoSchedule"),
                                   (f"{D}/xid", "48", "NoSchedule")],
     [(f"{D}/gpu-lost", None, "NoSchedule")]),
]


@pytest.mark.parametrize(("faults", "at0", "at4"), MIG_SCOPES)
@pytest.mark.parametrize("dynamic", [False, True])
async def test_mig_devices_carry_their_gpus_taints_and_their_own_instances(
        make_env: MakeEnv, faults: tuple[Fault, ...], at0: list[Any], at4: list[Any],
        dynamic: bool) -> None:
    """A MIG device carries its GPU's taints and those of faults scoped to its own instance
    (GI, and CI where NVML named one), in static and dynamic MIG alike."""
    facts, driver = await base(make_env, "dgx-h100")
    faulty = [dataclasses.replace(_mig(facts[0]), faults=faults), *facts[1:]]
    slices = render(faulty, driver, opts((1, 37), dynamic=dynamic))
    assert check(slices, (1, 37)) == []
    assert taints(slices, "gpu-0-mig-3g40gb-9-0") == at0
    assert taints(slices, "gpu-0-mig-3g40gb-9-4") == at4


async def test_a_transitions_marks_still_withhold_the_device(make_env: MakeEnv) -> None:
    """Placements a MIG transition drains or creates stay out, tainted GPU or not."""
    facts, driver = await base(make_env, "dgx-h100")
    mig = _mig(facts[0])
    marked = dataclasses.replace(mig, faults=(xid(48),),
                                 draining=frozenset({mig.gpu.mig_devices[1].placement}))
    slices = render([marked, *facts[1:]], driver, opts((1, 37)))
    assert taints(slices, "gpu-0-mig-3g40gb-9-4") is None
    assert taints(slices, "gpu-0-mig-3g40gb-9-0") == [(f"{D}/xid", "48", "NoSchedule")]


def _gpus(facts: GpuFacts, count: int, *faults: Fault) -> list[GpuFacts]:
    """``count`` GPUs like ``facts`` (minors 0..count-1), each with ``faults``."""
    s = facts.gpu.static
    return [dataclasses.replace(facts, faults=faults, gpu=dataclasses.replace(
        facts.gpu, static=dataclasses.replace(s, index=i, minor=i, uuid=f"GPU-{i:04d}")))
        for i in range(count)]


@pytest.mark.parametrize("kubernetes", [(1, 34), (1, 35), (1, 37)])
async def test_a_slice_with_tainted_devices_holds_at_most_64_from_1_35(
        make_env: MakeEnv, kubernetes: tuple[int, int]) -> None:
    """130 GPUs: two slices untainted (128 a slice); tainted, 64 a slice from 1.35 (the
    server's limit once devices carry taints), 128 on 1.34, which has no such limit."""
    facts, driver = await base(make_env, "l40s")
    plain = render(_gpus(facts[0], 130), driver, opts(kubernetes))
    assert [len(s["spec"]["devices"]) for s in plain] == [128, 2]
    tainted = render(_gpus(facts[0], 130, xid(48)), driver, opts(kubernetes))
    sizes = [len(s["spec"]["devices"]) for s in tainted]
    assert sizes == ([64, 64, 2] if rules_for(kubernetes).advanced_device_limit else [128, 2])
    assert check(tainted, kubernetes) == []


@pytest.mark.parametrize(("kubernetes", "kept"), [((1, 34), 4), ((1, 37), 16)])
def test_at_most_the_versions_taints_a_device_the_heaviest_kept(
        kubernetes: tuple[int, int], kept: int) -> None:
    """More taints than the version allows: the heaviest are kept (NoExecute, then
    NoSchedule), in key order."""
    many = [Taint(f"{D}/k{i:02d}", "None" if i % 3 else "NoSchedule", T0, "r")
            for i in range(20)] + [Taint(f"{D}/lost", "NoExecute", T0, "r")]
    out = published_taints(many, kubernetes)
    assert len(out) == min(kept, len([t for t in many if t.effect in
                                      rules_for(kubernetes).taint_effects]))
    assert {"key": f"{D}/lost", "effect": "NoExecute", "timeAdded": "2026-11-30T00:53:20Z"} \
        in out
    assert [t["key"] for t in out] == sorted(t["key"] for t in out)
    weights = {"NoExecute": 2, "NoSchedule": 1, "None": 0}
    dropped = [t for t in many if t.key not in {o["key"] for o in out}
               and t.effect in rules_for(kubernetes).taint_effects]
    assert all(weights[t.effect] <= min(weights[o["effect"]] for o in out) for t in dropped)


def test_a_gpu_without_a_minor_is_left_out() -> None:
    """A GPU lost before the agent started, whose name the agent does not know, has no
    device (its minor is -1): nothing invalid is published."""
    from agent.gpu.types import Gpu, GpuStatic, Health  # noqa: PLC0415 - this test only

    static = GpuStatic(index=5, minor=-1, uuid="GPU-LOST-5", name="unknown (GPU is lost)",
                       brand="unknown", architecture="unknown", cuda_compute_capability="",
                       pci_bus_id="", pci_device_id=0, pci_subsystem_id=0, memory_total_mib=0,
                       numa_node=None, cpu_affinity="", mig_capable=False)
    gpu = Gpu(static=static, mig_mode=None, mig_devices=(), health=Health(False, ("lost",)))
    slices = render([GpuFacts(gpu=gpu, faults=(LOST,))], DriverInfo("550.1", "12.4", "12.550"),
                    opts((1, 37)))
    assert devices(slices) == [] and check(slices, (1, 37)) == []
    known = dataclasses.replace(static, uuid="GPU-real", minor=5)
    slices = render([GpuFacts(gpu=dataclasses.replace(gpu, static=known), faults=(LOST,))],
                    DriverInfo("550.1", "12.4", "12.550"), opts((1, 37)))
    assert taints(slices, "gpu-5") == [(f"{D}/gpu-lost", None, "NoSchedule")]
    assert check(slices, (1, 37)) == []

