"""The renderer as a pure function: what each GPU publishes with --dynamic-mig for its MIG mode,
architecture, instances, holds and marks; NVIDIA's attribute names, types and values; and the
order the allocator reads (slice names, then devices)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from agent.device_names import mig_device_name
from agent.dra.resource_slices import GpuFacts, RenderOptions, render
from agent.dra.rules import quantity
from agent.gpu.types import DriverInfo, Gpu, MigDevice, MigMode, Placement
from agent.health.taints import Fault

from .conftest import MakeEnv

Json = dict[str, Any]
_BASE: dict[str, tuple[list[GpuFacts], DriverInfo]] = {}


async def base(make_env: MakeEnv, preset: str) -> tuple[list[GpuFacts], DriverInfo]:
    """The preset's GPUs as the service sees them with nothing changed (MIG off, no holds),
    read once per preset: the renderer's input is plain values."""
    if preset not in _BASE:
        env = await make_env(preset, name=preset)
        _BASE[preset] = (env.resource_slices.facts(), env.inventory.driver)
    return _BASE[preset]


def options(kubernetes: tuple[int, int] = (1, 35), *, dynamic: bool = True) -> RenderOptions:
    return RenderOptions(driver="gpu.nodeagent.dev", node_name="node-1", kubernetes=kubernetes,
                         dynamic_mig=dynamic)


def devices(slices: list[Json]) -> list[Json]:
    return [d for s in slices for d in s["spec"].get("devices") or []]


def names_of(slices: list[Json], minor: int = 0) -> set[str]:
    own = f"gpu-{minor}"
    return {d["name"] for d in devices(slices) if d["name"] == own
            or d["name"].startswith(own + "-")}


def instance(gpu: Gpu, profile: str, start: int, uuid: str = "MIG-test") -> MigDevice:
    spec = next(p for p in gpu.profiles if p.name == profile)
    placement = next(p for p in spec.placements if p.start == start)
    return MigDevice(index=0, uuid=uuid, profile=profile, gi_id=1, ci_id=0,
                     placement=placement, memory_mib=spec.memory_mib,
                     multiprocessors=spec.multiprocessors)


def placements(gpu: Gpu, *keep: str) -> set[str]:
    """Names of every (profile, placement) device of ``gpu`` whose profile is in ``keep``
    (all when empty)."""
    return {mig_device_name(gpu.static.minor, p.name, p.id, pl.start)
            for p in gpu.profiles if not keep or p.name in keep for pl in p.placements}


def mig_on(gpu: Gpu, *made: MigDevice, pending: bool | None = None) -> Gpu:
    on = MigMode(current=True, pending=True if pending is None else pending)
    return dataclasses.replace(gpu, mig_mode=on, mig_devices=made)


def with_facts(facts: GpuFacts, gpu: Gpu | None = None, **changes: Any) -> GpuFacts:
    return dataclasses.replace(facts, gpu=gpu or facts.gpu, **changes)


# (case, preset, change of GPU 0's facts, what GPU 0 publishes: a function of the GPU)
CASES = [
    ("hopper, MIG off: the full GPU and every placement", "dgx-h100",
     lambda f: f, lambda g: {"gpu-0"} | placements(g)),
    ("ampere, MIG off: the full GPU only (its mode is never toggled)", "dgx-a100",
     lambda f: f, lambda g: {"gpu-0"}),
    ("ampere, MIG on and empty: the placements only", "dgx-a100",
     lambda f: with_facts(f, mig_on(f.gpu)), placements),
    ("hopper, MIG on and empty: the placements, not the whole GPU", "dgx-h100",
     lambda f: with_facts(f, mig_on(f.gpu)), placements),
    ("hopper, MIG off with a change pending: the full GPU only", "dgx-h100",
     lambda f: with_facts(f, dataclasses.replace(f.gpu, mig_mode=MigMode(False, True))),
     lambda g: {"gpu-0"}),
    ("held whole over REST: the full GPU and nothing else", "dgx-h100",
     lambda f: with_facts(f, held_whole=True), lambda g: {"gpu-0"}),
    ("a 1g slice reserved at 0 (not made yet): it stays, all that overlaps it goes", "dgx-h100",
     lambda f: with_facts(f, held=frozenset({("1g.10gb", Placement(0, 1))})),
     lambda g: {n for n in placements(g) if not n.endswith("-0")} | {"gpu-0-mig-1g10gb-19-0"}),
    ("a 3g instance at 4: it (with its UUID) and what fits beside it", "dgx-h100",
     lambda f: with_facts(f, mig_on(f.gpu, instance(f.gpu, "3g.40gb", 4))),
     lambda g: {n for n in placements(g) if int(n.rsplit("-", 1)[1]) < 4
                and "-4g" not in n and "-7g" not in n and "-3g" not in n}
     | {"gpu-0-mig-3g40gb-9-4", "gpu-0-mig-4g40gb-5-0", "gpu-0-mig-3g40gb-9-0"}),
    ("a 3g instance at 4 being drained: nothing at slices 4-7", "dgx-h100",
     lambda f: with_facts(f, mig_on(f.gpu, instance(f.gpu, "3g.40gb", 4)),
                          draining=frozenset({Placement(4, 4)})),
     lambda g: {n for n in placements(g) if int(n.rsplit("-", 1)[1]) < 4
                and "-7g" not in n}),
    ("faulty (XID 79): everything still, tainted", "dgx-h100",
     lambda f: with_facts(f, faults=(Fault("xid", "XID 79", 1.0, value="79"),)),
     lambda g: {"gpu-0"} | placements(g)),
    ("no MIG (L40S): the full GPU, no counters", "l40s", lambda f: f, lambda g: {"gpu-0"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("kubernetes", [(1, 34), (1, 37)])
async def test_what_a_gpu_publishes_with_dynamic_mig(
        make_env: MakeEnv, case: tuple[str, str, Any, Any], kubernetes: tuple[int, int]) -> None:
    """Each GPU state publishes exactly the devices the scheduler may book and prepare can
    make; the other GPUs are untouched."""
    what, preset, change, expected = case
    facts, driver = await base(make_env, preset)
    changed = change(facts[0])
    slices = render([changed, *facts[1:]], driver, options(kubernetes))
    assert names_of(slices) == expected(changed.gpu), what
    assert names_of(slices, 1) == names_of(render(facts, driver, options(kubernetes)), 1)
    made = {d.uuid for d in changed.gpu.mig_devices}
    for device in devices(slices):
        if device["name"].startswith("gpu-0-mig-"):
            uuid = device["attributes"].get("uuid", {}).get("string")
            assert uuid is None or uuid in made


def _consumption(device: Json) -> dict[str, int]:
    return {name: int(quantity(value["value"]))
            for c in device.get("consumesCounters") or [] for name, value in c["counters"].items()}


def _counters(slices: list[Json]) -> dict[str, dict[str, int]]:
    return {cs["name"]: {n: int(quantity(v["value"])) for n, v in cs["counters"].items()}
            for s in slices for cs in s["spec"].get("sharedCounters") or []}


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100", "hgx-h200"])
@pytest.mark.parametrize("state", ["MIG off", "MIG on", "instances"])
async def test_counters_never_let_two_overlapping_devices_be_booked(
        make_env: MakeEnv, preset: str, state: str) -> None:
    """Every set of a GPU's published devices that fits its counters (what the allocator may
    book together) is a set of non-overlapping placements, the full GPU alone."""
    facts, driver = await base(make_env, preset)
    gpu = facts[0].gpu
    if state == "MIG on" or (state == "MIG off" and gpu.static.architecture == "ampere"):
        gpu = mig_on(gpu)
    elif state == "instances":
        two = next(p.name for p in gpu.profiles if p.name.startswith("2g"))
        gpu = mig_on(gpu, instance(gpu, two, 2))
    slices = render([with_facts(facts[0], gpu)], driver, options())
    counters = _counters(slices)["gpu-0-counter-set"]
    published = [(d["name"], _consumption(d)) for d in devices(slices)]
    assert len(published) > 5

    def spans(name: str) -> set[int]:
        if "-mig-" not in name:
            return set(range(8))
        start = int(name.rsplit("-", 1)[1])
        size = sum(1 for k in next(c for n, c in published if n == name) if
                   k.startswith("memory-slice-"))
        return set(range(start, start + size))

    booked = 0

    def grow(i: int, used: dict[str, int], chosen: list[str]) -> None:
        nonlocal booked
        for j in range(i, len(published)):
            name, takes = published[j]
            total = {k: used.get(k, 0) + v for k, v in takes.items()}
            if any(total[k] > counters[k] for k in total):
                continue
            for other in chosen:
                assert not spans(name) & spans(other), (name, other)
            booked += 1
            grow(j + 1, {**used, **total}, [*chosen, name])

    grow(0, {}, [])
    assert booked >= len(published)


NVIDIA_GPU = {"type": "string", "uuid": "string", "productName": "string", "brand": "string",
              "architecture": "string", "cudaComputeCapability": "version",
              "driverVersion": "version", "cudaDriverVersion": "version",
              "resource.kubernetes.io/pciBusID": "string",
              "resource.kubernetes.io/pcieRoot": "string",
              "resource.kubernetes.io/numaNode": "int"}
NVIDIA_MIG = {**NVIDIA_GPU, "profile": "string", "parentUUID": "string"}
NVIDIA_MIG_CAPACITY = {"multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines",
                       "ofaEngines", "memory"}


@pytest.mark.parametrize(("preset", "brand", "architecture"), [
    ("dgx-h100", "Nvidia", "Hopper"), ("dgx-a100", "Nvidia", "Ampere"),
    ("l40s", "Nvidia", "Ada Lovelace")])
async def test_attributes_match_nvidias_names_types_and_values(
        make_env: MakeEnv, preset: str, brand: str, architecture: str) -> None:
    """Every attribute NVIDIA's driver publishes is here with its type, brand and architecture
    spelled as NVIDIA spells them (so a selector copied from NVIDIA's docs matches); the
    project's extras come besides."""
    facts, driver = await base(make_env, preset)
    gpu = facts[0].gpu
    if gpu.static.mig_capable:
        gpu = mig_on(gpu, instance(gpu, gpu.profiles[0].name, 0, "MIG-x"))
    for dynamic in (False, True):
        found = {d["name"]: d for d in devices(render([with_facts(facts[0], gpu)], driver,
                                                      options(dynamic=dynamic)))}
        for name, device in found.items():
            kinds = {k: next(iter(v)) for k, v in device["attributes"].items()}
            wanted = NVIDIA_MIG if "-mig-" in name else NVIDIA_GPU
            if "-mig-" in name and "uuid" not in kinds:  # a placement not made yet
                wanted = {k: v for k, v in wanted.items() if k != "uuid"}
            assert {k: kinds.get(k) for k in wanted} == wanted, name
            assert device["attributes"]["brand"] == {"string": brand}
            assert device["attributes"]["architecture"] == {"string": architecture}
            assert "nvlinkBandwidth" in kinds
            if "-mig-" in name:
                assert set(device["capacity"]) >= NVIDIA_MIG_CAPACITY
                assert any(k.startswith("memorySlice") for k in device["capacity"])
            else:
                assert set(device["capacity"]) == {"memory"}


@pytest.mark.parametrize(("inventory", "published"), [
    ("hopper", "Hopper"), ("ampere", "Ampere"), ("ada", "Ada Lovelace"),
    ("blackwell", "Blackwell"), ("volta", "Volta"), ("unknown", "Unknown"),
    ("something-new", "something-new")])
async def test_architecture_values(make_env: MakeEnv, inventory: str, published: str) -> None:
    """The inventory's architecture becomes NVIDIA's word (unknown words pass unchanged)."""
    facts, driver = await base(make_env, "l40s")
    static = dataclasses.replace(facts[0].gpu.static, architecture=inventory)
    slices = render([with_facts(facts[0], dataclasses.replace(facts[0].gpu, static=static))],
                    driver, options(dynamic=False))
    assert devices(slices)[0]["attributes"]["architecture"] == {"string": published}


@pytest.mark.parametrize(("inventory", "published"), [
    ("nvidia", "Nvidia"), ("tesla", "Tesla"), ("nvidia_rtx", "NvidiaRTX"),
    ("quadro_rtx", "QuadroRTX"), ("geforce", "GeForce"), ("nvs", "NVS"),
    ("unknown", "Unknown")])
async def test_brand_values(make_env: MakeEnv, inventory: str, published: str) -> None:
    """The inventory's brand becomes NVIDIA's word."""
    facts, driver = await base(make_env, "l40s")
    static = dataclasses.replace(facts[0].gpu.static, brand=inventory)
    slices = render([with_facts(facts[0], dataclasses.replace(facts[0].gpu, static=static))],
                    driver, options(dynamic=False))
    assert devices(slices)[0]["attributes"]["brand"] == {"string": published}


def _many(facts: list[GpuFacts], count: int) -> list[GpuFacts]:
    """``count`` GPUs made from the preset's first, minors 0..count-1, in shuffled order."""
    made = []
    for minor in range(count):
        static = dataclasses.replace(facts[0].gpu.static, index=minor, minor=minor,
                                     uuid=f"GPU-{minor:04d}")
        made.append(with_facts(facts[0], dataclasses.replace(facts[0].gpu, static=static)))
    return made[::-1]


@pytest.mark.parametrize(("kubernetes", "dynamic", "gpus", "at_least"), [
    ((1, 35), True, 20, 23), ((1, 34), True, 12, 12), ((1, 37), False, 300, 3)])
async def test_name_order_is_device_order(make_env: MakeEnv, kubernetes: tuple[int, int],
                                          dynamic: bool, gpus: int, at_least: int) -> None:
    """Slices sorted by name (the allocator's first fit) hold the devices GPU by GPU in minor
    order (gpu-2 before gpu-10), counter slices first, and every slice name is unique."""
    facts, driver = await base(make_env, "dgx-h100")
    slices = render(_many(facts, gpus), driver, options(kubernetes, dynamic=dynamic))
    assert len(slices) >= at_least
    by_name = sorted(slices, key=lambda s: s["metadata"]["name"])
    assert by_name == slices
    assert len({s["metadata"]["name"] for s in slices}) == len(slices)
    minors = [int(d["name"].split("-")[1]) for d in devices(by_name)]
    assert minors == sorted(minors)
    if kubernetes >= (1, 35) and dynamic:
        kinds = ["counters" if "sharedCounters" in s["spec"] else "devices" for s in by_name]
        assert kinds == sorted(kinds)  # every counter slice before the first device slice
    for _, group in itertools.groupby(devices(by_name), key=lambda d: d["name"].split("-")[1]):
        names = [d["name"] for d in group]
        assert names[0] == f"gpu-{names[0].split('-')[1]}"  # the full GPU leads its GPU
