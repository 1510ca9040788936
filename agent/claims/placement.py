"""Where an on-demand MIG slice goes: fragmentation-aware placement, pure.

Every (GPU, placement) where the instance fits (a legal placement of the profile, no overlap,
within its instance limit and one ``+me`` per GPU; GPUs with MIG disabled, a geometry their
catalog rejects or no such profile are skipped) is a candidate. The best is chosen by, in
order (each step only breaks the ties of the ones before):

1. **room for the large profiles**, those taking at least half the GPU's memory slices (on an
   H100 7g, 4g, 3g): after placing, each one's remaining capacity (how many more instances of
   it alone would fit, as NVML's ``GetGpuInstanceRemainingCapacity``) summed over the
   candidate GPUs, largest profile first, compared lexicographically. So: never start an
   empty GPU while the slice fits on a used one, then keep the half a 4g needs (slices 0-3),
   then the halves a 3g needs;
2. **no stranded slice**: the fewest free memory slices on the chosen GPU that no profile
   could use any more (no free placement of a profile with room left covers them). On an H100
   a 1g.10gb at slice 6 strands slice 7, which only a 1g.20gb at 6, a 3g at 4 or a 7g uses;
3. **room for the small profiles** (under half the GPU: 2g, 1g.20gb, 1g.10gb), as in 1.
   Media-extension profiles (``+me``) count in neither 1 nor 3: they use their base profile's
   placements, and counting them again would penalise taking a GPU's last 1g slot (the
   opposite of best fit);
4. **best fit**: the fewest free memory slices left on the chosen GPU;
5. the lowest GPU index, then the lowest start.

Out-of-order releases otherwise leave free slices no larger profile can use (dra-driver #933).
Only the chosen GPU changes, so 1 and 3 compare its change in remaining capacity. The order of
the steps was chosen on ``bench/packing.py`` over several seeds; it does not use the demand
mix, which a node agent does not know.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from agent.gpu.types import Placement
from agent.mig.geometry import Catalog, Geometry, ProfileSpec, remaining_capacity


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


def _mask(p: Placement) -> int:
    return ((1 << p.size) - 1) << p.start


def _orders(candidates: Sequence[Candidate]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The profile names compared in steps 1 and 3, each largest first, over every catalog."""
    specs: dict[str, tuple[ProfileSpec, Catalog]] = {}
    for c in candidates:
        for spec in c.catalog.profiles:
            specs.setdefault(spec.name, (spec, c.catalog))
    large: list[ProfileSpec] = []
    small: list[ProfileSpec] = []
    for spec, catalog in specs.values():
        if spec.media_extensions or not spec.placements:
            continue
        (large if 2 * spec.memory_slices >= catalog.memory_slices else small).append(spec)

    def names(group: list[ProfileSpec]) -> tuple[str, ...]:
        return tuple(s.name for s in sorted(group, key=lambda s: s.size_key, reverse=True))

    return names(large), names(small)


@lru_cache(maxsize=4096)
def _state(catalog: Catalog, used: int,
           counts: tuple[tuple[str, int], ...]) -> tuple[Mapping[str, int], int]:
    """(remaining capacity per profile, stranded slices) of a GPU with the memory slices in
    ``used`` (a bitmask) taken and ``counts`` instances per profile. Stranded: free slices that
    no free placement of a profile with room left covers. Memoised: a node sees few states."""
    room = remaining_capacity(catalog, used, dict(counts))
    cover = 0
    for spec in catalog.profiles:
        if room[spec.name]:
            for p in spec.placements:
                m = _mask(p)
                if not used & m:
                    cover |= m
    free = ((1 << catalog.memory_slices) - 1) & ~used
    return MappingProxyType(room), bin(free & ~cover).count("1")


def choose(candidates: Sequence[Candidate], profile: str,
           start: int | None = None) -> Choice | None:
    """The best (GPU, placement) for one ``profile`` instance, or None when it fits nowhere."""
    large, small = _orders(candidates)
    best: tuple[tuple[int, ...], int, tuple[int, ...], int, int, int] | None = None
    choice: Choice | None = None
    for candidate in candidates:
        catalog, geometry = candidate.catalog, candidate.geometry
        if not catalog.knows(profile) or not geometry.mig_enabled \
                or not geometry.is_valid(catalog):
            continue
        used, counts = geometry.used_slices(), geometry.counts()
        room, stranded = _state(catalog, used, tuple(sorted(counts.items())))
        if not room.get(profile, 0):
            continue  # instance limit, +me or no free placement: fits nowhere here
        after_counts = tuple(sorted({**counts, profile: counts.get(profile, 0) + 1}.items()))
        for placement in geometry.free_placements(catalog.profile(profile)):
            if start is not None and placement.start != start:
                continue
            after_used = used | _mask(placement)
            after, after_stranded = _state(catalog, after_used, after_counts)
            key = (tuple(after.get(n, 0) - room.get(n, 0) for n in large),
                   stranded - after_stranded,
                   tuple(after.get(n, 0) - room.get(n, 0) for n in small),
                   bin(after_used).count("1") - catalog.memory_slices,  # -free slices
                   -candidate.index, -placement.start)
            if best is None or key > best:
                best, choice = key, Choice(candidate.index, placement)
    return choice
