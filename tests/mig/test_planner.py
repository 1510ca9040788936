"""The MIG planner, as specifications: named cases over the real H100 and A100 tables, a
round-trip over every valid geometry, and properties checked against brute force over the
exhaustive enumeration of valid geometries (``tests/mig/catalogs.py``)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.api.problems import problem_of
from agent.errors import GeometryNotPlaceable, InvalidRequest
from agent.gpu.types import Placement
from agent.mig.geometry import (
    Catalog,
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    Plan,
)
from agent.mig.planner import plan
from tests.mig.catalogs import (
    A100_40GB,
    CATALOGS,
    H100_80GB,
    Layout,
    all_layouts,
    layouts_by_multiset,
)

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


def inst(text: str, gi_id: int | None = None) -> Instance:
    """``"3g.40gb@0:4"``; a trailing ``!`` marks the instance held."""
    held = text.endswith("!")
    name, where = text.rstrip("!").split("@")
    start, size = where.split(":")
    return Instance(name, Placement(int(start), int(size)), gi_id=gi_id, held=held)


def geo(text: str = "", *, enabled: bool = True) -> Geometry:
    """A current geometry from ``"3g.40gb@0:4 1g.10gb@4:1!"``, with GI ids 1, 2, ..."""
    return Geometry(enabled, tuple(inst(t, gi_id=n + 1) for n, t in enumerate(text.split())))


def explicit(text: str) -> DesiredInstances:
    return DesiredInstances(tuple((i.profile, i.placement) for i in map(inst, text.split())))


def names(items: tuple[Instance, ...]) -> list[str]:
    """Instances as ``inst`` reads them (held ones with ``!``)."""
    return [f"{i}!" if i.held else str(i) for i in items]


# --- named cases -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    current: Geometry
    desired: Desired
    keep: list[str] = field(default_factory=list)
    destroy: list[str] = field(default_factory=list)
    create: list[str] = field(default_factory=list)
    enabled_after: bool = True
    catalog: Catalog = H100_80GB


TRAP = DesiredProfiles.of(["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"])
BALANCED = "3g.40gb@4:4 2g.20gb@0:2 1g.10gb@2:1 1g.10gb@3:1"

CASES = [
    Case("the MIG guide's ordering trap places 3g in the upper half, largest first",
         geo(enabled=False), TRAP,
         create=["3g.40gb@4:4", "2g.20gb@0:2", "1g.10gb@2:1", "1g.10gb@3:1"]),
    Case("the ordering trap on A100-40GB, where the names differ",
         geo(), DesiredProfiles.of(["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]),
         create=["3g.20gb@4:4", "2g.10gb@0:2", "1g.5gb@2:1", "1g.5gb@3:1"], catalog=A100_40GB),
    Case("an already applied multiset is an empty plan",
         geo(BALANCED), TRAP, keep=["2g.20gb@0:2", "1g.10gb@2:1", "1g.10gb@3:1", "3g.40gb@4:4"]),
    Case("already applied explicit instances are an empty plan",
         geo(BALANCED), explicit(BALANCED),
         keep=["2g.20gb@0:2", "1g.10gb@2:1", "1g.10gb@3:1", "3g.40gb@4:4"]),
    Case("disabling destroys every instance",
         geo("3g.40gb@0:4 1g.10gb@4:1"), DesiredDisabled(),
         destroy=["3g.40gb@0:4", "1g.10gb@4:1"], enabled_after=False),
    Case("disabling a disabled GPU is an empty plan", geo(enabled=False), DesiredDisabled(),
         enabled_after=False),
    Case("enabling with no instances changes only the mode", geo(enabled=False),
         DesiredProfiles({})),
    Case("no instances with MIG on destroys them all and leaves MIG on",
         geo("7g.80gb@0:8"), DesiredProfiles({"7g.80gb": 0}), destroy=["7g.80gb@0:8"]),
    Case("explicit placements keep what matches and create the rest",
         geo("3g.40gb@0:4 1g.10gb@4:1 1g.10gb@5:1"), explicit("2g.20gb@4:2 3g.40gb@0:4"),
         keep=["3g.40gb@0:4"], destroy=["1g.10gb@4:1", "1g.10gb@5:1"], create=["2g.20gb@4:2"]),
    Case("adding to a layout keeps it and leaves room for a 1g.20gb",
         geo("3g.40gb@0:4"), DesiredProfiles({"3g.40gb": 1, "1g.10gb": 2}),
         keep=["3g.40gb@0:4"], create=["1g.10gb@4:1", "1g.10gb@5:1"]),
    Case("a single 1g goes where it blocks the least (slot 6, as the driver does)",
         geo(), DesiredProfiles({"1g.10gb": 1}), create=["1g.10gb@6:1"]),
    Case("of two 3g the one whose removal leaves room for a 2g is kept",
         geo("3g.40gb@0:4 3g.40gb@4:4"), DesiredProfiles({"3g.40gb": 1, "1g.10gb": 2}),
         keep=["3g.40gb@4:4"], destroy=["3g.40gb@0:4"], create=["1g.10gb@0:1", "1g.10gb@1:1"]),
    Case("without holders the layout leaving room for a 2g wins, moving the 1g at 4",
         geo("1g.10gb@0:1 1g.10gb@4:1"), DesiredProfiles({"3g.40gb": 1, "1g.10gb": 1}),
         keep=["1g.10gb@0:1"], destroy=["1g.10gb@4:1"], create=["3g.40gb@4:4"]),
    Case("a held instance is kept where a non-held one is moved",
         geo("1g.10gb@0:1 1g.10gb@4:1!"), DesiredProfiles({"3g.40gb": 1, "1g.10gb": 1}),
         keep=["1g.10gb@4:1!"], destroy=["1g.10gb@0:1"], create=["3g.40gb@0:4"]),
    Case("keeping one held instance beats keeping three others",
         geo("1g.10gb@0:1 1g.10gb@1:1 1g.10gb@2:1 1g.10gb@4:1!"),
         DesiredProfiles({"3g.40gb": 1, "1g.10gb": 3}),
         keep=["1g.10gb@4:1!"], destroy=["1g.10gb@0:1", "1g.10gb@1:1", "1g.10gb@2:1"],
         create=["3g.40gb@0:4", "1g.10gb@5:1", "1g.10gb@6:1"]),
    Case("a held instance that no layout can keep is still destroyed",
         geo("4g.40gb@0:4!"), DesiredProfiles({"3g.40gb": 2}),
         destroy=["4g.40gb@0:4!"], create=["3g.40gb@0:4", "3g.40gb@4:4"]),
    Case("an instance of a profile the GPU does not know is destroyed",
         geo("9g.99gb@0:1"), DesiredProfiles({"1g.10gb": 1}),
         destroy=["9g.99gb@0:1"], create=["1g.10gb@6:1"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_case(case: Case) -> None:
    """Each named case gives exactly the expected keep, destroy and create lists."""
    p = plan(case.catalog, case.current, case.desired)
    assert (names(p.keep), names(p.destroy), names(p.create)) == (
        sorted(case.keep, key=lambda t: inst(t).sort_key),
        sorted(case.destroy, key=lambda t: inst(t).sort_key), case.create)
    assert p.mig_enabled_before == case.current.mig_enabled
    assert p.mig_enabled_after == case.enabled_after
    assert p.empty == (not case.destroy and not case.create
                       and case.current.mig_enabled == case.enabled_after)
    assert all(i.gi_id is None and not i.held for i in p.create)
    p.target().validate(case.catalog)


IMPOSSIBLE = [
    ("two 3g use every slice",
     DesiredProfiles({"3g.40gb": 2, "1g.10gb": 1}),
     "3g.40gb at 0:4 and 3g.40gb at 4:4 use all 8 memory slices; "
     "no slice is left for 1g.10gb"),
    ("7g takes the whole GPU",
     DesiredProfiles({"7g.80gb": 1, "1g.10gb": 1}),
     "7g.80gb at 0:8 uses all 8 memory slices; no slice is left for 1g.10gb"),
    ("the last free slice is one no 1g may start at",
     DesiredProfiles({"2g.20gb": 3, "1g.10gb": 2}),
     "2g.20gb at 0:2, 2g.20gb at 2:2, 2g.20gb at 4:2 and 1g.10gb at 6:1 leave only memory "
     "slice 7 free; 1g.10gb needs 1 memory slice starting at 0, 1, 2, 3, 4, 5 or 6"),
    ("more instances than the profile allows",
     DesiredProfiles({"1g.20gb": 5}), "5 x 1g.20gb asked; at most 4 fit on one GPU"),
    ("one 4g at most", DesiredProfiles({"4g.40gb": 2}),
     "2 x 4g.40gb asked; at most 1 fits on one GPU"),
    ("+me once per GPU", DesiredProfiles({"1g.10gb+me": 2}),
     "1g.10gb+me at most once per GPU (asked 2)"),
    ("explicit placement at a start the profile cannot take",
     explicit("2g.20gb@1:2"), "2g.20gb may start only at 0, 2 or 4 (asked 1)"),
    ("explicit placement of the wrong size",
     explicit("3g.40gb@4:3"), "3g.40gb at 4 occupies 4 memory slices (asked 4:3)"),
    ("explicit instances that overlap",
     explicit("2g.20gb@2:2 3g.40gb@0:4"), "explicit 3g.40gb at 0:4 overlaps 2g.20gb at 2:2"),
    ("explicit +me twice", explicit("1g.10gb+me@0:1 1g.10gb+me@1:1"),
     "1g.10gb+me at most once per GPU (asked 2)"),
]


@pytest.mark.parametrize(("desired", "message"), [(d, m) for _, d, m in IMPOSSIBLE],
                         ids=[n for n, _, _ in IMPOSSIBLE])
def test_impossible_geometry_says_why(desired: Desired, message: str) -> None:
    """An impossible geometry is a 422 GeometryNotPlaceable whose detail a person understands."""
    with pytest.raises(GeometryNotPlaceable) as err:
        plan(H100_80GB, geo("1g.10gb@0:1"), desired)
    assert err.value.detail == message
    assert problem_of(err.value).status == 422


@pytest.mark.parametrize("desired", [
    DesiredProfiles({"1g.5gb": 1}), DesiredProfiles({"1g.5gb": 0}), explicit("1g.5gb@0:1")])
def test_unknown_profile_is_invalid_request(desired: Desired) -> None:
    """A profile the GPU does not offer is an InvalidRequest naming it, even with count 0."""
    with pytest.raises(InvalidRequest, match=r"unknown MIG profile '1g\.5gb'"):
        plan(H100_80GB, geo(), desired)


def test_create_order_is_largest_first() -> None:
    """Instances are created largest first, then by start, whatever order they were asked in."""
    p = plan(H100_80GB, geo(),
             explicit("1g.10gb@6:1 1g.20gb@4:2 2g.20gb@2:2 1g.10gb+me@1:1 1g.10gb@0:1"))
    assert names(p.create) == ["2g.20gb@2:2", "1g.20gb@4:2", "1g.10gb@0:1",
                               "1g.10gb+me@1:1", "1g.10gb@6:1"]


def test_plan_is_deterministic() -> None:
    """The same inputs give the same plan, and its journal form reads back equal."""
    current = geo("3g.40gb@0:4 1g.10gb@4:1! 1g.10gb@6:1")
    desired = DesiredProfiles({"2g.20gb": 2, "1g.10gb": 2})
    first = plan(H100_80GB, current, desired)
    assert plan(H100_80GB, current, desired) == first
    assert Plan.from_dict(first.to_dict()) == first


# --- round trip over every valid geometry ------------------------------------------------


def _geometry(layout: Layout) -> Geometry:
    return Geometry(True, tuple(Instance(n, p, gi_id=k + 1) for k, (n, p) in enumerate(layout)))


@pytest.mark.parametrize("catalog", CATALOGS.values(), ids=CATALOGS.keys())
def test_round_trip_over_every_valid_geometry(catalog: Catalog) -> None:
    """For every valid geometry G: planning G's multiset on an empty GPU gives a valid layout
    with that multiset, and planning G's own multiset or instances from G does nothing."""
    layouts = all_layouts(catalog)
    assert len(layouts) == 2319  # identical placement tables on A100 and H100
    for layout in layouts:
        g = _geometry(layout)
        fresh = plan(catalog, Geometry(True), DesiredProfiles(g.counts())).target()
        fresh.validate(catalog)
        assert fresh.counts() == g.counts()
        assert plan(catalog, g, DesiredProfiles(g.counts())).empty
        assert plan(catalog, g, DesiredInstances(g.layout())).empty


# --- properties against brute force ------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Catalog, Geometry, DesiredProfiles]:
    catalog = draw(st.sampled_from(list(CATALOGS.values())))
    layouts = all_layouts(catalog)
    layout = draw(st.sampled_from(layouts))
    held = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
    current = Geometry(True, tuple(Instance(n, p, gi_id=k + 1, held=h)
                                   for k, ((n, p), h) in enumerate(zip(layout, held, strict=True))))
    placeable = st.sampled_from(layouts).map(lambda lay: dict(Counter(n for n, _ in lay)))
    anything = st.fixed_dictionaries(
        {}, optional={spec.name: st.integers(0, spec.max_instances + 1)
                      for spec in catalog.profiles})
    # Near the current multiset: where keeping held instances competes with keeping many.
    nearby = st.fixed_dictionaries(
        {spec.name: st.integers(-2, 2) for spec in catalog.profiles}).map(
        lambda delta: {name: max(0, current.counts().get(name, 0) + d)
                       for name, d in delta.items()})
    counts = draw(st.one_of(placeable, nearby, anything))
    return catalog, current, DesiredProfiles(counts)


def _kept(layout: Layout, current: Geometry) -> tuple[int, int]:
    """(held instances kept, instances kept) if ``current`` became ``layout``."""
    keys = set(layout)
    return (sum(1 for i in current.instances if i.held and i.key in keys),
            sum(1 for i in current.instances if i.key in keys))


def _room(catalog: Catalog, layout: Layout) -> tuple[int, ...]:
    """Remaining capacity per profile, largest profile first."""
    room = _geometry(layout).remaining_capacity(catalog)
    return tuple(room[spec.name] for spec in catalog.largest_first())


@PROPERTY_SETTINGS
@given(scenarios())
def test_plan_is_valid_complete_and_keeps_the_most(
        scenario: tuple[Catalog, Geometry, DesiredProfiles]) -> None:
    """Either no valid geometry has the desired multiset and the planner says so, or the plan's
    target is valid with exactly that multiset, kept + destroyed is the current geometry, kept
    instances are unchanged, no valid geometry keeps more held ones, or as many held ones and
    more in all, none of those that keep as many leaves more room, and replanning is a no-op."""
    catalog, current, desired = scenario
    candidates = layouts_by_multiset(catalog).get(frozenset(desired.multiset().items()), [])
    try:
        p = plan(catalog, current, desired)
    except GeometryNotPlaceable:
        assert not candidates
        return
    assert candidates
    target = p.target()
    target.validate(catalog)
    assert target.counts() == desired.multiset()
    assert sorted(p.keep + p.destroy) == list(current.instances)
    assert set(p.keep) <= set(current.instances)
    assert all(i.gi_id is None for i in p.create)
    best = max(_kept(c, current) for c in candidates)
    assert _kept(target.layout(), current) == best
    assert _room(catalog, target.layout()) == max(
        _room(catalog, c) for c in candidates if _kept(c, current) == best)
    assert plan(catalog, target, desired).empty


def _competing(catalog: Catalog, count: int, seed: int) -> list[tuple[Geometry, Layout]]:
    """Seeded random (current with held instances, desired layout) pairs where keeping the most
    held instances means keeping fewer in all: rare among uniform draws, so searched for."""
    rng = random.Random(seed)
    layouts = [lay for lay in all_layouts(catalog) if len(lay) >= 2]
    groups = list(layouts_by_multiset(catalog).values())
    found: list[tuple[Geometry, Layout]] = []
    while len(found) < count:
        layout, candidates = rng.choice(layouts), rng.choice(groups)
        current = Geometry(True, tuple(Instance(n, p, gi_id=k + 1, held=rng.random() < 0.3)
                                       for k, (n, p) in enumerate(layout)))
        best = max(_kept(c, current) for c in candidates)
        if best[1] < max(_kept(c, current)[1] for c in candidates):
            found.append((current, candidates[0]))
    return found


@pytest.mark.parametrize("catalog", CATALOGS.values(), ids=CATALOGS.keys())
def test_held_instances_come_before_keeping_the_most(catalog: Catalog) -> None:
    """Where keeping every held instance possible means keeping fewer in all, the planner keeps
    the held ones (brute force over every layout with the desired multiset agrees)."""
    for current, wanted in _competing(catalog, count=40, seed=7):
        candidates = layouts_by_multiset(catalog)[frozenset(Counter(n for n, _ in wanted).items())]
        target = plan(catalog, current, DesiredProfiles(Counter(n for n, _ in wanted))).target()
        assert _kept(target.layout(), current) == max(_kept(c, current) for c in candidates)


@st.composite
def explicit_scenarios(draw: st.DrawFn) -> tuple[Catalog, Geometry, Geometry]:
    catalog = draw(st.sampled_from(list(CATALOGS.values())))
    current, wanted = (draw(st.sampled_from(all_layouts(catalog))) for _ in range(2))
    return catalog, _geometry(current), Geometry(True, tuple(Instance(n, p) for n, p in wanted))


@PROPERTY_SETTINGS
@given(explicit_scenarios())
def test_explicit_plan_keeps_exactly_the_common_instances(
        scenario: tuple[Catalog, Geometry, Geometry]) -> None:
    """With explicit instances the target is exactly what was asked, the kept instances are
    exactly those current and asked have in common, and everything else is destroyed."""
    catalog, current, wanted = scenario
    p = plan(catalog, current, DesiredInstances(wanted.layout()))
    assert p.target().same_layout(wanted)
    assert {i.key for i in p.keep} == set(current.layout()) & set(wanted.layout())
    assert {i.key for i in p.destroy} == set(current.layout()) - set(wanted.layout())
    assert p.empty == current.same_layout(wanted)


@PROPERTY_SETTINGS
@given(st.sampled_from(list(CATALOGS.values())).flatmap(
    lambda c: st.tuples(st.just(c), st.sampled_from(all_layouts(c)))))
def test_disabling_destroys_everything(scenario: tuple[Catalog, Layout]) -> None:
    """Disabling MIG destroys every instance and keeps none."""
    catalog, layout = scenario
    current = _geometry(layout)
    p = plan(catalog, current, DesiredDisabled())
    assert p.keep == () and p.create == ()
    assert p.destroy == current.instances
    assert p.target() == Geometry(False)
