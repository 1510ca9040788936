"""The MIG value types: catalog look-ups, geometry algebra and validation, desired states and
plans, and their journal (dict) round-trips."""

from __future__ import annotations

import json

import pytest

from agent.api.problems import problem_of
from agent.errors import GeometryNotPlaceable, InvalidRequest
from agent.gpu.types import Placement
from agent.mig.geometry import (
    Catalog,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    Plan,
    ProfileSpec,
    join_words,
    max_disjoint,
)
from tests.mig.catalogs import A100_40GB, CATALOGS, H100_80GB, all_layouts


def P(start: int, size: int) -> Placement:
    return Placement(start=start, size=size)


def geo(*items: tuple[str, int, int], enabled: bool = True) -> Geometry:
    return Geometry(mig_enabled=enabled,
                    instances=tuple(Instance(name, P(s, n)) for name, s, n in items))


# --- catalog -----------------------------------------------------------------------------


def test_catalog_lookup_by_name_and_id() -> None:
    """A profile is found by its name and by its device profile id; an unknown id is None."""
    assert H100_80GB.profile("3g.40gb").id == 9
    assert H100_80GB.by_id(15) == H100_80GB.profile("1g.20gb")
    assert A100_40GB.by_id(15) == A100_40GB.profile("1g.10gb")
    assert H100_80GB.by_id(7) is None


def test_unknown_profile_names_it_and_the_known_ones() -> None:
    """An unknown profile name is an InvalidRequest that names it and lists what the GPU offers."""
    with pytest.raises(InvalidRequest) as err:
        H100_80GB.profile("1g.5gb")
    assert err.value.detail == (
        "unknown MIG profile '1g.5gb'; this GPU offers 1g.10gb, 1g.10gb+me, 1g.20gb, "
        "2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb")


def test_catalog_rejects_duplicates_and_out_of_range_placements() -> None:
    """A catalog with a repeated name or id, or a placement past the last slice, is refused."""
    spec = H100_80GB.profile("2g.20gb")
    with pytest.raises(ValueError, match="listed twice"):
        Catalog(profiles=(spec, spec))
    with pytest.raises(ValueError, match="outside"):
        Catalog(profiles=(spec,), memory_slices=4)


def test_catalog_largest_first_order() -> None:
    """Largest first means compute slices, then memory slices, then memory."""
    assert [p.name for p in H100_80GB.largest_first()] == [
        "7g.80gb", "4g.40gb", "3g.40gb", "2g.20gb", "1g.20gb", "1g.10gb+me", "1g.10gb"]


@pytest.mark.parametrize(("profile", "placement", "message"), [
    ("2g.20gb", P(1, 2), "2g.20gb may start only at 0, 2 or 4 (asked 1)"),
    ("3g.40gb", P(0, 3), "3g.40gb at 0 occupies 4 memory slices (asked 0:3)"),
    ("7g.80gb", P(0, 7), "7g.80gb at 0 occupies 8 memory slices (asked 0:7)"),
    ("1g.10gb", P(7, 1), "1g.10gb may start only at 0, 1, 2, 3, 4, 5 or 6 (asked 7)"),
    ("1g.20gb", P(6, 2), None),
])
def test_placement_problem(profile: str, placement: Placement, message: str | None) -> None:
    """A placement not in the profile's NVML list is named with the starts it may take."""
    assert H100_80GB.profile(profile).placement_problem(placement) == message


def test_profile_without_placements() -> None:
    """A profile NVML lists no placement for cannot be placed anywhere."""
    spec = ProfileSpec(name="x", id=1, slices=1, memory_mib=1, multiprocessors=1,
                       max_instances=0, placements=())
    assert spec.placement_problem(P(0, 1)) == "x has no placement on this GPU"
    assert spec.memory_slices == 0


# --- instances and geometry --------------------------------------------------------------


def test_geometry_sorts_instances_by_start_then_profile() -> None:
    """A geometry's instances are kept sorted, so equal layouts compare equal in any order."""
    a = geo(("3g.40gb", 4, 4), ("1g.10gb", 0, 1), ("2g.20gb", 2, 2))
    b = geo(("2g.20gb", 2, 2), ("3g.40gb", 4, 4), ("1g.10gb", 0, 1))
    assert a == b
    assert [str(i) for i in a.instances] == ["1g.10gb@0:1", "2g.20gb@2:2", "3g.40gb@4:4"]


def test_used_slices_and_counts() -> None:
    """used_slices is the bitmask of occupied memory slices; counts the profile multiset."""
    g = geo(("1g.10gb", 0, 1), ("1g.10gb", 1, 1), ("3g.40gb", 4, 4))
    assert g.used_slices() == 0b1111_0011
    assert g.counts() == {"1g.10gb": 2, "3g.40gb": 1}
    assert Geometry(mig_enabled=False).used_slices() == 0


def test_same_layout_ignores_gi_ids_and_held() -> None:
    """same_layout compares mode, profiles and placements only."""
    a = Geometry(True, (Instance("3g.40gb", P(0, 4), gi_id=1, held=True),))
    b = Geometry(True, (Instance("3g.40gb", P(0, 4)),))
    assert a != b
    assert a.same_layout(b)
    assert not a.same_layout(Geometry(True, (Instance("3g.40gb", P(4, 4)),)))
    assert not Geometry(True).same_layout(Geometry(False))


@pytest.mark.parametrize("catalog", CATALOGS.values(), ids=CATALOGS.keys())
def test_every_enumerated_layout_is_valid(catalog: Catalog) -> None:
    """validate accepts every layout the independent enumeration calls valid."""
    for layout in all_layouts(catalog):
        Geometry(True, tuple(Instance(n, p) for n, p in layout)).validate(catalog)


@pytest.mark.parametrize(("geometry", "message"), [
    (geo(("3g.40gb", 0, 4), ("2g.20gb", 2, 2)), "2g.20gb at 2:2 overlaps 3g.40gb at 0:4"),
    (geo(("2g.20gb", 1, 2)), "2g.20gb may start only at 0, 2 or 4 (asked 1)"),
    (geo(*(("1g.10gb", s, 1) for s in range(7)), ("1g.10gb", 0, 1)),
     "8 x 1g.10gb asked; at most 7 fit on one GPU"),
    (geo(("1g.10gb+me", 0, 1), ("1g.10gb+me", 1, 1)), "1g.10gb+me at most once per GPU (asked 2)"),
    (geo(("1g.10gb", 0, 1), enabled=False), "MIG is disabled but 1 GPU instance is listed"),
])
def test_validate_rejects_with_a_reason(geometry: Geometry, message: str) -> None:
    """validate names the first thing that cannot exist: illegal placement, +me, count, overlap."""
    assert not geometry.is_valid(H100_80GB)
    with pytest.raises(GeometryNotPlaceable) as err:
        geometry.validate(H100_80GB)
    assert err.value.detail == message
    assert problem_of(err.value).status == 422


def test_validate_unknown_profile_is_invalid_request() -> None:
    """A profile the catalog lacks is an InvalidRequest from validate, and not valid."""
    g = geo(("1g.5gb", 0, 1))
    assert not g.is_valid(H100_80GB)
    with pytest.raises(InvalidRequest):
        g.validate(H100_80GB)


def test_remaining_capacity_counts_free_disjoint_placements() -> None:
    """Remaining capacity is NVML's: free non-overlapping placements, capped by max and +me."""
    assert Geometry(True).remaining_capacity(H100_80GB) == {
        "1g.10gb": 7, "1g.10gb+me": 1, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2,
        "4g.40gb": 1, "7g.80gb": 1}
    # reference/mig.md §2.2: after one 3g at 0:4, 1g.* drops from 7 to 3.
    after = geo(("3g.40gb", 0, 4), ("1g.10gb+me", 4, 1)).remaining_capacity(H100_80GB)
    assert after == {"1g.10gb": 2, "1g.10gb+me": 0, "1g.20gb": 1, "2g.20gb": 0,
                     "3g.40gb": 0, "4g.40gb": 0, "7g.80gb": 0}
    assert set(Geometry(False).remaining_capacity(H100_80GB).values()) == {0}


def test_free_placements() -> None:
    """free_placements lists the profile's placements no instance overlaps."""
    g = geo(("2g.20gb", 2, 2))
    assert g.free_placements(H100_80GB.profile("3g.40gb")) == (P(4, 4),)
    assert g.free_placements(H100_80GB.profile("2g.20gb")) == (P(0, 2), P(4, 2))


def test_max_disjoint() -> None:
    """max_disjoint is the size of the largest set of pairwise disjoint placements."""
    assert max_disjoint([P(0, 4), P(2, 2), P(4, 4), P(6, 2)]) == 2
    assert max_disjoint([]) == 0


def test_geometry_dict_round_trip_over_every_layout() -> None:
    """to_dict is plain JSON and from_dict gives the same geometry back, for every layout."""
    for n, layout in enumerate(all_layouts(H100_80GB)):
        g = Geometry(True, tuple(Instance(name, p, gi_id=n % 5 or None, held=n % 2 == 0)
                                 for name, p in layout))
        assert Geometry.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_from_dict_ignores_unknown_keys_and_rejects_malformed() -> None:
    """A newer writer's extra keys are ignored; a malformed record is a ValueError."""
    data = {"mig_enabled": True, "future": 1,
            "instances": [{"profile": "3g.40gb", "placement": {"start": 0, "size": 4},
                           "gi_id": 2, "ci_profile": 9}]}
    assert Geometry.from_dict(data) == Geometry(True, (Instance("3g.40gb", P(0, 4), gi_id=2),))
    for bad in ({}, {"mig_enabled": "yes"}, {"mig_enabled": True, "instances": [{}]},
                {"mig_enabled": True, "instances": [{"profile": 1, "placement": {}}]},
                {"mig_enabled": True,
                 "instances": [{"profile": "x", "placement": {"start": "0", "size": 1}}]},
                {"mig_enabled": True, "instances": 3}):
        with pytest.raises(ValueError):
            Geometry.from_dict(bad)


# --- desired state -----------------------------------------------------------------------


def test_desired_profiles_is_a_multiset() -> None:
    """Desired profiles compare and hash by their counts; `of` counts a list of names."""
    a = DesiredProfiles({"3g.40gb": 1, "1g.10gb": 2})
    b = DesiredProfiles.of(["1g.10gb", "3g.40gb", "1g.10gb"])
    assert a == b
    assert hash(a) == hash(b)
    assert str(a) == "2x1g.10gb + 1x3g.40gb"
    assert str(DesiredProfiles({})) == "no instances"


def test_desired_profiles_allows_zero_and_rejects_negative() -> None:
    """A count of 0 is allowed (and means none); negative or non-integer counts are refused."""
    assert DesiredProfiles({"1g.10gb": 0}).multiset() == {}
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InvalidRequest):
            DesiredProfiles({"1g.10gb": bad})  # type: ignore[dict-item]


def test_desired_instances_counts() -> None:
    """Explicit instances keep the caller's order and count as a multiset."""
    d = DesiredInstances((("2g.20gb", P(2, 2)), ("1g.10gb", P(0, 1)), ("2g.20gb", P(4, 2))))
    assert d.counts() == {"1g.10gb": 1, "2g.20gb": 2}
    assert d.instances[0] == ("2g.20gb", P(2, 2))


# --- plan --------------------------------------------------------------------------------


def _plan() -> Plan:
    return Plan(keep=(Instance("1g.10gb", P(0, 1), gi_id=7), Instance("2g.20gb", P(2, 2), gi_id=4)),
                destroy=(Instance("3g.40gb", P(4, 4), gi_id=2),),
                create=(Instance("1g.10gb", P(4, 1)), Instance("1g.10gb", P(5, 1))),
                mig_enabled_before=True, mig_enabled_after=True)


def test_plan_summary_is_one_line() -> None:
    """The summary counts kept instances and lists destroyed and created ones."""
    assert _plan().summary() == \
        "keep 2, destroy 1 (3g.40gb@4:4), create 2 (1g.10gb@4:1, 1g.10gb@5:1)"
    off = Plan(keep=(), destroy=(), create=(), mig_enabled_before=True, mig_enabled_after=False)
    assert off.summary() == "disable MIG, keep 0, destroy 0, create 0"


def test_plan_empty_and_target() -> None:
    """A plan is empty only with nothing to destroy or create and no mode change; its target
    is kept plus created."""
    p = _plan()
    assert not p.empty
    assert p.target() == Geometry(True, p.keep + p.create)
    assert Plan(keep=p.keep, destroy=(), create=(), mig_enabled_before=True,
                mig_enabled_after=True).empty
    assert not Plan(keep=(), destroy=(), create=(), mig_enabled_before=False,
                    mig_enabled_after=True).empty


def test_plan_dict_round_trip() -> None:
    """A plan survives the journal: JSON out, the same plan (order included) back."""
    p = _plan()
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError):
        Plan.from_dict({"keep": []})
    with pytest.raises(ValueError):
        Plan.from_dict({"mig_enabled_before": 1, "mig_enabled_after": True})


def test_join_words() -> None:
    """Lists read as English: commas, then 'and' or 'or' before the last."""
    assert join_words([]) == ""
    assert join_words([0]) == "0"
    assert join_words([0, 2, 4], "or") == "0, 2 or 4"
