"""Where an on-demand MIG slice goes: fragmentation-aware placement, pure.

Objective, in order:
1. keep the most room for the largest profiles still to come: after placing, compare the
   remaining capacity of every profile, largest first (7g, then 4g, 3g, ...), summed over the
   candidate GPUs;
2. best fit: prefer the GPU with the fewest free memory slices left (fill used GPUs before
   starting on empty ones);
3. deterministic: lowest GPU index, then lowest start.
Out-of-order releases otherwise leave free slices no larger profile can use (dra-driver #933).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.gpu.types import Placement
from agent.mig.geometry import Catalog, Geometry, Instance


@dataclass(frozen=True)
class Candidate:
    """A GPU a slice may go on: its index, catalog and current (or reserved) geometry."""

    index: int
    catalog: Catalog
    geometry: Geometry


@dataclass(frozen=True)
class Choice:
    index: int
    placement: Placement


def _room(candidates: Mapping[int, Candidate], geometries: Mapping[int, Geometry]) -> tuple[
        int, ...]:
    """Remaining capacity per profile, largest profile first, summed over the GPUs."""
    any_catalog = next(iter(candidates.values())).catalog
    order = [spec.name for spec in any_catalog.largest_first()]
    totals = dict.fromkeys(order, 0)
    for index, candidate in candidates.items():
        capacity = geometries[index].remaining_capacity(candidate.catalog)
        for name in order:
            totals[name] += capacity.get(name, 0)
    return tuple(totals[name] for name in order)


def _free_slices(geometry: Geometry, slices: int) -> int:
    return slices - bin(geometry.used_slices()).count("1")


def choose(candidates: Sequence[Candidate], profile: str,
           start: int | None = None) -> Choice | None:
    """The best (GPU, placement) for one ``profile`` instance, or None when it fits nowhere."""
    if not candidates:
        return None
    by_index = {c.index: c for c in candidates}
    geometries = {c.index: c.geometry for c in candidates}
    best: tuple[tuple[int, ...], int, int, int] | None = None
    choice: Choice | None = None
    for candidate in candidates:
        if not candidate.catalog.knows(profile):
            continue
        spec = candidate.catalog.profile(profile)
        for placement in candidate.geometry.free_placements(spec):
            if start is not None and placement.start != start:
                continue
            after = Geometry(mig_enabled=True, instances=(*candidate.geometry.instances,
                                                          Instance(profile, placement)))
            if not after.is_valid(candidate.catalog):
                continue
            trial = dict(geometries)
            trial[candidate.index] = after
            key = (_room(by_index, trial),
                   -_free_slices(after, candidate.catalog.memory_slices),
                   -candidate.index, -placement.start)
            if best is None or key > best:
                best, choice = key, Choice(candidate.index, placement)
    return choice
