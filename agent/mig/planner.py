"""The MIG planner: from the current geometry and a desired state to a :class:`Plan` that keeps
every instance that can stay where it is and places every new one explicitly. Pure: no NVML,
no I/O; the transition executor applies the plan.

For a multiset of profiles the planner looks at every legal layout of that multiset (8 memory
slices make that a small, exhaustive search, memoised on the used-slice bitmask) and picks the
one that

1. keeps the most *held* current instances (claims, running processes) in place, then
2. keeps the most current instances in place, then
3. leaves the most room for the future: the remaining capacity of each profile, largest
   profile first, compared as a tuple, then
4. puts the largest instances at the lowest starts (deterministic).

Unlike mig-parted, which tries creation orders on the live GPU with driver auto-placement
(``reference/mig.md`` §3), the MIG guide's ordering trap (``1g, 1g, 2g, 3g``) cannot arise: the
plan names every placement, and the executor creates largest first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from functools import lru_cache
from itertools import combinations

from agent.errors import GeometryNotPlaceable
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
    ProfileSpec,
    count_problem,
    join_words,
    layout_problem,
    media_extensions_problem,
    remaining_capacity,
)

# A layout: (profile name, placement) pairs, largest profile first, each profile's starts
# ascending.
Layout = tuple[tuple[str, Placement], ...]
# What is still to place: (profile name, count) pairs, largest profile first.
Demand = tuple[tuple[str, int], ...]


def plan(catalog: Catalog, current: Geometry, desired: Desired) -> Plan:
    """The plan from ``current`` to ``desired`` on a GPU whose profiles are ``catalog``.

    :class:`GeometryNotPlaceable` (with the reason in words) when no legal geometry matches
    ``desired``; :class:`~agent.errors.InvalidRequest` for a profile the GPU does not offer.
    An already applied desired state gives an empty plan.
    """
    if isinstance(desired, DesiredDisabled):
        return _make_plan(catalog, current, (), enabled=False)
    if isinstance(desired, DesiredInstances):
        problem = layout_problem(catalog, desired.instances, explicit=True)
        if problem:
            raise GeometryNotPlaceable(problem)
        return _make_plan(catalog, current, desired.instances, enabled=True)
    return _make_plan(catalog, current, _choose_layout(catalog, current, desired),
                      enabled=True)


# --- building the plan -------------------------------------------------------------------


def _make_plan(catalog: Catalog, current: Geometry, target: Layout, *, enabled: bool) -> Plan:
    """Keep the current instances the target has (one each; a held one first), destroy the
    rest, create what is missing, largest first."""
    waiting: dict[tuple[str, Placement], list[Instance]] = {}
    for inst in sorted(current.instances, key=lambda i: (not i.held, i.sort_key)):
        waiting.setdefault(inst.key, []).append(inst)
    keep: list[Instance] = []
    create: list[Instance] = []
    for name, placement in target:
        matches = waiting.get((name, placement))
        if matches:
            keep.append(matches.pop(0))
        else:
            create.append(Instance(profile=name, placement=placement))
    destroy = [inst for left in waiting.values() for inst in left]
    return Plan(keep=tuple(sorted(keep)), destroy=tuple(sorted(destroy)),
                create=_creation_order(catalog, create), mig_enabled_before=current.mig_enabled,
                mig_enabled_after=enabled)


def _creation_order(catalog: Catalog, create: list[Instance]) -> tuple[Instance, ...]:
    """Largest first (compute slices, then memory slices), then lowest start."""
    def key(inst: Instance) -> tuple[int, int, int, int, str]:
        slices, memory_slices, mib, _ = catalog.profile(inst.profile).size_key
        return (-slices, -memory_slices, -mib, inst.placement.start, inst.profile)
    return tuple(sorted(create, key=key))


# --- choosing a layout for a multiset ----------------------------------------------------


def _choose_layout(catalog: Catalog, current: Geometry, desired: DesiredProfiles) -> Layout:
    wanted = desired.multiset()
    for name in desired.counts:
        catalog.profile(name)  # an unknown name is an InvalidRequest, even with count 0
    _check_counts(catalog, wanted)
    demand = _demand(catalog, wanted)
    layouts = _layouts(catalog, demand, 0)
    if not layouts:
        raise GeometryNotPlaceable(_why_not_placeable(catalog, demand))

    held = {i.key for i in current.instances if i.held}
    present = {i.key for i in current.instances}

    def score(layout: Layout) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        return (-sum(1 for k in layout if k in held),
                -sum(1 for k in layout if k in present),
                _room(catalog, _used(layout), demand),
                tuple(p.start for _, p in layout))

    return min(layouts, key=score)


def _check_counts(catalog: Catalog, wanted: Mapping[str, int]) -> None:
    me = {name: n for name, n in wanted.items() if catalog.profile(name).media_extensions}
    if sum(me.values()) > 1:
        raise GeometryNotPlaceable(media_extensions_problem(me))
    for name, n in wanted.items():
        spec = catalog.profile(name)
        if n > spec.max_instances:
            raise GeometryNotPlaceable(count_problem(spec, n))


def _demand(catalog: Catalog, wanted: Mapping[str, int]) -> Demand:
    return tuple((spec.name, wanted[spec.name]) for spec in catalog.largest_first()
                 if wanted.get(spec.name))


def _mask(p: Placement) -> int:
    return ((1 << p.size) - 1) << p.start


def _used(layout: Layout) -> int:
    used = 0
    for _, p in layout:
        used |= _mask(p)
    return used


def _choices(spec: ProfileSpec, count: int, used: int) -> Iterator[tuple[Placement, ...]]:
    """Sets of ``count`` disjoint placements of ``spec`` in the slices free in ``used``, each
    ascending by start, in lexicographic order."""
    free = sorted((p for p in spec.placements if not used & _mask(p)),
                  key=lambda p: (p.start, p.size))
    for combo in combinations(free, count):
        if all(not a.overlaps(b) for a, b in combinations(combo, 2)):
            yield combo


@lru_cache(maxsize=8192)
def _layouts(catalog: Catalog, demand: Demand, used: int) -> tuple[Layout, ...]:
    """Every legal layout of ``demand`` in the slices free in ``used`` (memoised on the
    bitmask), in lexicographic order of starts."""
    if not demand:
        return ((),)
    (name, count), rest = demand[0], demand[1:]
    spec = catalog.profile(name)
    need = sum(catalog.profile(n).memory_slices * c for n, c in demand)
    if need > catalog.memory_slices - used.bit_count():
        return ()  # pruned: not enough free slices left, whatever the placement
    out: list[Layout] = []
    for combo in _choices(spec, count, used):
        mask = used
        for p in combo:
            mask |= _mask(p)
        head = tuple((name, p) for p in combo)
        out.extend(head + tail for tail in _layouts(catalog, rest, mask))
    return tuple(out)


@lru_cache(maxsize=8192)
def _room(catalog: Catalog, used: int, demand: Demand) -> tuple[int, ...]:
    """The room a layout leaves, as a key to minimise: minus the remaining capacity of each
    profile, largest profile first."""
    room = remaining_capacity(catalog, used, dict(demand))
    return tuple(-room[spec.name] for spec in catalog.largest_first())


# --- explaining an impossible multiset ---------------------------------------------------


def _why_not_placeable(catalog: Catalog, demand: Demand) -> str:
    """Place instances largest first while that is possible; name the first one that cannot
    be added to any layout of those before it, and what the lowest of those layouts leaves."""
    items = [name for name, n in demand for _ in range(n)]
    placed: Layout = ()
    for k in range(1, len(items) + 1):
        layouts = _layouts(catalog, tuple(Counter(items[:k]).items()), 0)
        if not layouts:
            return _blocked(catalog, placed, catalog.profile(items[k - 1]))
        placed = layouts[0]
    raise AssertionError("a placeable demand was reported as not placeable")  # pragma: no cover


def _blocked(catalog: Catalog, placed: Layout, spec: ProfileSpec) -> str:
    if not placed:
        return f"{spec.name} has no placement on this GPU"
    listed = join_words([f"{name} at {p.start}:{p.size}" for name, p in placed])
    used = _used(placed)
    total = catalog.memory_slices
    if used == (1 << total) - 1:
        verb = "uses" if len(placed) == 1 else "use"
        return (f"{listed} {verb} all {total} memory slices; "
                f"no slice is left for {spec.name}")
    free = [s for s in range(total) if not used >> s & 1]
    verb = "leaves" if len(placed) == 1 else "leave"
    slices = f"memory slice {free[0]}" if len(free) == 1 else \
        f"memory slices {join_words(free)}"
    size = spec.memory_slices
    return (f"{listed} {verb} only {slices} free; {spec.name} needs {size} memory "
            f"slice{'' if size == 1 else 's'} starting at {join_words(spec.starts, 'or')}")
