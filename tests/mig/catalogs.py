"""MIG profile catalogs of real GPUs for tests, from ``reference/mig.md``: placements from the
``nvidia-smi mig -lgipp`` table (§1.2, identical on A100 and H100), instance counts, memory and
SMs from ``-lgip`` (§1.5). Plus an independent, brute-force enumeration of every valid geometry
of a catalog, the oracle the planner tests compare against."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from functools import cache

from agent.gpu.types import Placement
from agent.mig.geometry import Catalog, ProfileSpec

# Device profile id -> (starts, memory slices), the real -lgipp output.
PLACEMENTS: dict[int, tuple[tuple[int, ...], int]] = {
    19: ((0, 1, 2, 3, 4, 5, 6), 1),
    20: ((0, 1, 2, 3, 4, 5, 6), 1),
    15: ((0, 2, 4, 6), 2),
    14: ((0, 2, 4), 2),
    9: ((0, 4), 4),
    5: ((0,), 4),
    0: ((0,), 8),
}


def _gib(shown: float) -> int:
    """MiB from the GiB ``-lgip`` prints (whole eighths of a GiB, two decimals)."""
    return round(shown * 8) * 128


# One row per profile: name, device profile id, compute slices, MiB, SMs, max instances.
Row = tuple[str, int, int, int, int, int]


def _catalog(*rows: Row) -> Catalog:
    """A catalog from -lgip rows; the id gives the placements, ``+me`` the media extensions."""
    specs = []
    for name, id, slices, mib, sms, max_instances in rows:
        starts, size = PLACEMENTS[id]
        specs.append(ProfileSpec(
            name=name, id=id, slices=slices, memory_mib=mib, multiprocessors=sms,
            max_instances=max_instances,
            placements=tuple(Placement(start=s, size=size) for s in starts),
            media_extensions=name.endswith("+me")))
    return Catalog(profiles=tuple(specs))


H100_80GB = _catalog(
    ("1g.10gb", 19, 1, _gib(9.75), 16, 7),
    ("1g.10gb+me", 20, 1, _gib(9.75), 16, 1),
    ("1g.20gb", 15, 1, _gib(19.62), 26, 4),
    ("2g.20gb", 14, 2, _gib(19.62), 32, 3),
    ("3g.40gb", 9, 3, 40448, 60, 2),
    ("4g.40gb", 5, 4, 40448, 64, 1),
    ("7g.80gb", 0, 7, _gib(79.25), 132, 1),
)

# A100-SXM4-40GB: the REV2 1-slice profile is "1g.10gb" here and the 2g is "2g.10gb".
A100_40GB = _catalog(
    ("1g.5gb", 19, 1, 4864, 14, 7),
    ("1g.5gb+me", 20, 1, 4864, 14, 1),
    ("1g.10gb", 15, 1, 9856, 14, 4),
    ("2g.10gb", 14, 2, 9856, 28, 3),
    ("3g.20gb", 9, 3, 19968, 42, 2),
    ("4g.20gb", 5, 4, 19968, 56, 1),
    ("7g.40gb", 0, 7, 40192, 98, 1),
)

CATALOGS = {"h100": H100_80GB, "a100": A100_40GB}

Layout = tuple[tuple[str, Placement], ...]


def _enumerate(catalog: Catalog, start: int, used: int) -> Iterator[Layout]:
    """Every set of disjoint legal placements on slices ``start``.. not in ``used``: at each
    slice either no instance starts there, or one of any profile that may start there."""
    if start >= catalog.memory_slices:
        yield ()
        return
    yield from _enumerate(catalog, start + 1, used)
    if used >> start & 1:
        return
    for spec in catalog.profiles:
        for p in spec.placements:
            mask = ((1 << p.size) - 1) << p.start
            if p.start == start and not used & mask:
                for rest in _enumerate(catalog, start + 1, used | mask):
                    yield ((spec.name, p), *rest)


@cache
def all_layouts(catalog: Catalog) -> tuple[Layout, ...]:
    """Every valid MIG layout of ``catalog`` (the empty one included), sorted by start: legal
    disjoint placements, instance counts within each profile's maximum, at most one ``+me``."""
    me = {s.name for s in catalog.profiles if s.media_extensions}
    maxima = {s.name: s.max_instances for s in catalog.profiles}
    out = []
    for layout in _enumerate(catalog, 0, 0):
        counts = Counter(name for name, _ in layout)
        if all(n <= maxima[name] for name, n in counts.items()) \
                and sum(counts[name] for name in me) <= 1:
            out.append(layout)
    return tuple(out)


def multiset(layout: Layout) -> frozenset[tuple[str, int]]:
    return frozenset(Counter(name for name, _ in layout).items())


@cache
def layouts_by_multiset(catalog: Catalog) -> dict[frozenset[tuple[str, int]], list[Layout]]:
    """The valid layouts grouped by their multiset of profiles."""
    out: dict[frozenset[tuple[str, int]], list[Layout]] = {}
    for layout in all_layouts(catalog):
        out.setdefault(multiset(layout), []).append(layout)
    return out
