"""ResourceSlices of the presets: the Kubernetes schema (kubernetes-validate, strict), the API
server's own rules, the layouts per version, what is left out, and the counters."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from agent.device_names import parse_device_name
from agent.dra.resource_slices import consumption_of, counters_of, semver
from agent.dra.rules import check, quantity
from agent.gpu.sim.presets import PRESETS
from agent.gpu.types import GiProfile

from .conftest import Env, MakeEnv

VERSIONS = [(1, 34), (1, 35), (1, 36), (1, 37)]


def validate(slices: list[dict[str, Any]], version: tuple[int, int]) -> None:
    """Schema-valid at that version and free of API-server rule violations."""
    for item in slices:
        kubernetes_validate.validate(item, f"{version[0]}.{version[1]}.0", strict=True)
    assert check(slices, version) == []


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def h100_geometry(env: Env) -> None:
    """GPU 0: 3g@0 + 2g@4 + 1g@6; GPU 1: MIG on, empty; the rest whole."""
    env.make_mig(0, [(9, 0), (14, 4), (19, 6)])
    env.make_mig(1, [])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dynamic", [False, True])
async def test_dgx_h100_slices_validate(make_env: MakeEnv, version: tuple[int, int],
                                        dynamic: bool) -> None:
    """Done-when: dgx-h100 slices, static and dynamic MIG, 1.34 and 1.35 layouts, pass the
    strict schema and the server's rules."""
    env = await make_env("dgx-h100", dynamic_mig=dynamic, setup=h100_geometry)
    slices = await env.resource_slices.of_version(version)
    validate(slices, version)
    assert all(s["spec"]["driver"] == "gpu.nodeagent.dev" for s in slices)
    assert {s["spec"]["pool"]["name"] for s in slices} == {"gpu-node-1"}


@pytest.mark.parametrize("preset", ["dgx-a100", "hgx-h200", "a100-pcie-bridged", "l40s"])
async def test_other_presets_validate_in_every_mode(make_env: MakeEnv, preset: str) -> None:
    for dynamic in (False, True):
        env = await make_env(preset, dynamic_mig=dynamic, name=f"{preset}-{dynamic}")
        for version in VERSIONS:
            validate(await env.resource_slices.of_version(version), version)


async def test_static_devices_and_attributes(make_env: MakeEnv) -> None:
    """Static: full GPUs where MIG is off, the existing MIG devices where it is on (nothing
    for a MIG GPU without instances); names parse back; versions are semver."""
    env = await make_env("dgx-h100", setup=h100_geometry)
    found = devices(await env.resource_slices.of_version((1, 35)))
    assert "gpu-0" not in found and "gpu-1" not in found
    assert {n for n in found if n.startswith("gpu-0-")} == {
        "gpu-0-mig-3g40gb-9-0", "gpu-0-mig-2g20gb-14-4", "gpu-0-mig-1g10gb-19-6"}
    assert {f"gpu-{i}" for i in range(2, 8)} <= set(found)
    for name in found:
        assert parse_device_name(name) is not None
    gpu = found["gpu-2"]["attributes"]
    assert gpu["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu["driverVersion"] == {"version": "570.133.20"}
    assert gpu["nvlinkBandwidth"] == {"int": 450}
    assert gpu["resource.kubernetes.io/pciBusID"]["string"] == "0000:52:00.0"
    assert gpu["resource.kubernetes.io/pcieRoot"]["string"].startswith("pci0000:")
    assert gpu["resource.kubernetes.io/numaNode"] == {"int": 0}
    islands = {d["attributes"]["nvlinkIsland"]["string"] for d in found.values()}
    assert len(islands) == 1
    mig = found["gpu-0-mig-3g40gb-9-0"]
    assert mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert mig["attributes"]["parentUUID"] == {"string": env.node.gpu_uuids()[0]}
    assert "uuid" in mig["attributes"]
    assert {k for k in mig["capacity"] if k.startswith("memorySlice")} == {
        f"memorySlice{i}" for i in range(4)}
    assert mig["capacity"]["multiprocessors"] == {"value": "60"}


async def test_bridged_islands_follow_the_bridges(make_env: MakeEnv) -> None:
    """nvlinkIsland is shared exactly by bridge partners."""
    env = await make_env("a100-pcie-bridged")
    found = devices(await env.resource_slices.of_version((1, 35)))
    island = {int(n.split("-")[1]): d["attributes"]["nvlinkIsland"]["string"]
              for n, d in found.items()}
    for a, b in ((0, 2), (1, 3), (4, 5), (6, 7)):
        assert island[a] == island[b]
    assert len(set(island.values())) == 4


async def test_l40s_has_no_island_attribute(make_env: MakeEnv) -> None:
    env = await make_env("l40s", dynamic_mig=True)
    found = devices(await env.resource_slices.of_version((1, 35)))
    assert sorted(found) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert all("nvlinkIsland" not in d["attributes"] and "consumesCounters" not in d
               for d in found.values())


async def test_dynamic_layouts(make_env: MakeEnv) -> None:
    """>= 1.35: a counter slice (one set per GPU) then device-only slices; 1.34: one slice per
    GPU holding its set and its devices. Each GPU: the full GPU plus every placement of
    every profile (25 on H100)."""
    env = await make_env("dgx-h100", dynamic_mig=True)
    new = await env.resource_slices.of_version((1, 35))
    assert "sharedCounters" in new[0]["spec"] and "devices" not in new[0]["spec"]
    assert len(new[0]["spec"]["sharedCounters"]) == 8
    assert all("sharedCounters" not in s["spec"] for s in new[1:])
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in new} == {9}
    old = await env.resource_slices.of_version((1, 34))
    assert len(old) == 8
    assert all(len(s["spec"]["sharedCounters"]) == 1 and len(s["spec"]["devices"]) == 26
               for s in old)
    found = devices(new)
    assert len(found) == 8 * 26
    full = found["gpu-3"]
    assert full["consumesCounters"][0]["counterSet"] == "gpu-3-counter-set"
    assert "uuid" not in found["gpu-3-mig-1g10gb-19-6"]["attributes"]


async def test_dynamic_hides_overlaps_and_drains(make_env: MakeEnv) -> None:
    """With instances on GPU 0: the full GPU and every device overlapping an instance of
    another shape are gone, the instances' own devices stay (with their UUID); a draining
    instance's device goes too. A faulty or quarantined GPU publishes its devices tainted."""
    env = await make_env("dgx-h100", dynamic_mig=True,
                         setup=lambda e: e.make_mig(0, [(9, 0), (19, 6)]))
    found = devices(await env.resource_slices.of_version((1, 35)))
    gpu0 = {n for n in found if n.startswith("gpu-0")}
    assert "gpu-0" not in gpu0
    assert "gpu-0-mig-3g40gb-9-0" in gpu0 and "uuid" in found["gpu-0-mig-3g40gb-9-0"][
        "attributes"]
    assert "gpu-0-mig-1g10gb-19-6" in gpu0
    assert "gpu-0-mig-4g40gb-5-0" not in gpu0 and "gpu-0-mig-1g10gb-19-0" not in gpu0
    assert {"gpu-0-mig-1g10gb-19-4", "gpu-0-mig-1g10gb-19-5", "gpu-0-mig-2g20gb-14-4"} <= gpu0
    three_g = next(d for d in env.inventory.gpus[0].mig_devices if d.profile == "3g.40gb")
    env.drain(0, three_g.placement)
    env.quarantine(5, "rollback failed")
    env.node.inject_xid(env.node.gpu_uuids()[6], 79)
    slices = await env.resource_slices.of_version((1, 35))
    validate(slices, (1, 35))
    found = devices(slices)
    assert "gpu-0-mig-3g40gb-9-0" not in found
    for minor, key in ((5, "quarantined"), (6, "gpu-lost")):
        own = [d for n, d in found.items() if n == f"gpu-{minor}"
               or n.startswith(f"gpu-{minor}-")]
        assert own and all(f"gpu.nodeagent.dev/{key}" in {t["key"] for t in d["taints"]}
                           for d in own)


async def test_static_drain_leaves_the_device_out(make_env: MakeEnv) -> None:
    env = await make_env("dgx-h100", setup=h100_geometry)
    two_g = next(d for d in env.inventory.gpus[0].mig_devices if d.profile == "2g.20gb")
    env.drain(0, two_g.placement)
    found = devices(await env.resource_slices.of_version((1, 34)))
    assert "gpu-0-mig-2g20gb-14-4" not in found and "gpu-0-mig-3g40gb-9-0" in found


def _geometries(profiles: tuple[GiProfile, ...]) -> list[list[tuple[GiProfile, int]]]:
    """Every set of GPU instances the hardware accepts: placements that do not overlap, no
    more instances of a profile than it allows."""
    options = [(p, pl.start) for p in profiles for pl in p.placements]
    found: list[list[tuple[GiProfile, int]]] = [[]]

    def grow(start: int, chosen: list[tuple[GiProfile, int]], used: set[int]) -> None:
        for i in range(start, len(options)):
            profile, at = options[i]
            slots = set(range(at, at + profile.placements[0].size))
            if slots & used or sum(1 for p, _ in chosen if p.id == profile.id) >= \
                    profile.max_instances:
                continue
            found.append([*chosen, (profile, at)])
            grow(i + 1, [*chosen, (profile, at)], used | slots)

    grow(0, [], set())
    return found


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100", "hgx-h200"])
async def test_counters_cover_every_valid_geometry(make_env: MakeEnv, preset: str) -> None:
    """A GPU's devices never consume more than its counters: every geometry the hardware
    accepts fits them, and two overlapping placements never do (a memory slice twice)."""
    env = await make_env(preset)
    profiles = env.inventory.gpus[0].profiles
    counters = counters_of(profiles)
    by_start = {p.id: {pl.start: pl for pl in p.placements} for p in profiles}
    geometries = _geometries(profiles)
    assert len(geometries) > 100
    for geometry in geometries:
        total: dict[str, int] = dict.fromkeys(counters, 0)
        for profile, start in geometry:
            for name, value in consumption_of(profile, by_start[profile.id][start]).items():
                total[name] += value
        assert all(total[n] <= counters[n] for n in counters), geometry
    one = next(p for p in profiles if p.id == 19)
    two = next(p for p in profiles if p.id == 14)
    both = [consumption_of(one, by_start[19][4]), consumption_of(two, by_start[14][4])]
    assert sum(c.get("memory-slice-4", 0) for c in both) > counters["memory-slice-4"]


def test_semver() -> None:
    """Versions become semver 2.0.0: three numeric parts, no leading zeros."""
    assert semver("9.0") == "9.0.0"
    assert semver("535.104.05") == "535.104.5"
    assert semver("12.8") == "12.8.0"
    assert semver("570.133.20") == "570.133.20"
    assert semver("unknown") is None


def test_quantities() -> None:
    assert quantity("81559Mi") == 81559 * 2**20
    assert quantity("16") == 16 and quantity("1k") == 1000
    with pytest.raises(ValueError):
        quantity("lots")


def _slice(spec: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"driver": "gpu.nodeagent.dev", "nodeName": "n",
                            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "n-0"}, "spec": {**base, **spec}}


def _device(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "attributes": {"uuid": {"string": "x"}}, **extra}


COUNTERS = [{"name": "cs", "counters": {f"c{i}": {"value": "2"} for i in range(20)}}]


@pytest.mark.parametrize(("version", "spec", "needle"), [
    ((1, 35), {"sharedCounters": COUNTERS, "devices": [_device("a")]}, "only one of"),
    ((1, 35), {"devices": [_device(f"d{i}", consumesCounters=[
        {"counterSet": "cs", "counters": {"c0": {"value": "1"}}}]) for i in range(65)]},
     "at most 64 once devices consume counters"),
    ((1, 34), {"devices": [_device(f"d{i}") for i in range(129)]}, "at most 128"),
    ((1, 34), {"sharedCounters": COUNTERS * 2}, "defined twice"),
    ((1, 34), {"sharedCounters": [{"name": "cs", "counters": {
        f"c{i}": {"value": "1"} for i in range(33)}}]}, "33 shared counters"),
    ((1, 35), {"sharedCounters": [{"name": f"s{i}", "counters": {"c": {"value": "1"}}}
                                  for i in range(9)]}, "9 counter sets"),
    ((1, 34), {"devices": [_device("a", attributes={
        "v": {"version": "9.0"}})]}, "not a semver"),
    ((1, 34), {"devices": [_device("a", attributes={"s": {"string": "x" * 65}})]},
     "longer than 64"),
    ((1, 34), {"devices": [_device("Bad_Name")]}, "not a DNS label"),
    ((1, 34), {"devices": [_device("a"), _device("a")]}, "appears twice"),
    ((1, 34), {"devices": [_device("a", capacity={f"k{i}": {"value": "1"} for i in range(32)})]},
     "33 attributes and capacities"),
    ((1, 34), {"sharedCounters": COUNTERS, "devices": [_device("a", consumesCounters=[
        {"counterSet": "cs", "counters": {"c0": {"value": "3"}}}])]}, "more than the"),
    ((1, 34), {"devices": [_device("a", consumesCounters=[
        {"counterSet": "other", "counters": {"c0": {"value": "1"}}}])]}, "not defined"),
    ((1, 34), {"pool": {"name": "n", "generation": -1, "resourceSliceCount": 1},
               "devices": []}, "generation"),
    ((1, 34), {"pool": {"name": "n", "generation": 1, "resourceSliceCount": 2},
               "devices": []}, "does not match"),
    ((1, 34), {"driver": "GPU.example", "devices": []}, "DNS subdomain"),
])
def test_server_rules_catch_violations(version: tuple[int, int], spec: dict[str, Any],
                                       needle: str) -> None:
    """Each API-server rule the schema cannot express is enforced by ``check``."""
    problems = check([_slice(spec)], version)
    assert any(needle in p for p in problems), problems


def test_1_34_allows_counters_with_devices_and_1_35_across_slices() -> None:
    """1.34 accepts counters and devices together (in one slice only); 1.35 accepts a device
    consuming a counter set published in another slice of the pool."""
    together = _slice({"sharedCounters": COUNTERS, "devices": [_device("a", consumesCounters=[
        {"counterSet": "cs", "counters": {"c0": {"value": "1"}}}])]})
    assert check([together], (1, 34)) == []
    pool = {"name": "n", "generation": 1, "resourceSliceCount": 2}
    apart = [_slice({"pool": pool, "sharedCounters": COUNTERS}),
             _slice({"pool": pool, "devices": [_device("a", consumesCounters=[
                 {"counterSet": "cs", "counters": {"c0": {"value": "1"}}}])]})]
    assert check(apart, (1, 35)) == []
    assert any("not defined in the slice" in p for p in check(apart, (1, 34)))


def test_every_preset_profile_fits_the_attribute_limit() -> None:
    """A MIG device of the largest profile keeps attributes + capacities within 32 even with a
    fabric clique (the limit is per device)."""
    for preset in PRESETS.values():
        for profile in preset.gpu.gi_profiles:
            capacity = 7 + profile.size
            attributes = 17  # type, uuid, profile, parentUUID and 13 shared at most
            assert capacity + attributes <= 32, (preset.name, profile.id)
