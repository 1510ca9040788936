"""Disruption of MIG reconfiguration: instances destroyed by the planner's plan, against
mig-parted's clear-and-recreate and against the true minimum found by brute force.

For each preset the catalog of GPU 0 is read through the real hardware layer from the simulated
node. Every valid geometry of that catalog is enumerated (legal, disjoint placements, each
profile within its maximum count, at most one ``+me`` instance). A seeded RNG then draws pairs
of two different geometries, uniformly among all valid ones: the first is the current geometry,
the multiset of profiles of the second is the desired state. Per pair:

- ``planned``: ``len(plan(catalog, current, DesiredProfiles(counts)).destroy)``;
- ``clear-and-recreate``: what mig-parted does (``reference/mig.md`` §3): nothing when the
  current multiset already equals the desired one (``Equals``), otherwise every current
  instance is destroyed;
- ``minimum``: ``len(current)`` minus the most current instances (same profile and placement)
  that any valid geometry of the desired multiset contains.

The planning time is measured per pair with :func:`time.perf_counter` around :func:`plan` in
the same run (the planner's memo caches warm up as the run goes, as they do in the agent).
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from agent.gpu.inventory import read_gi_profiles, read_static
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Placement
from agent.mig.catalog import catalog_of
from agent.mig.geometry import Catalog, DesiredProfiles, Geometry, Instance
from agent.mig.planner import plan

PRESETS = ("dgx-h100", "dgx-a100", "hgx-h200", "a100-pcie-bridged")
DEFAULT_PAIRS = 1000
DEFAULT_SEED = 1

# A geometry as a set of (profile, placement); placements are disjoint, so no duplicates.
Layout = frozenset[tuple[str, Placement]]
# A multiset of profiles: sorted (profile, count) pairs.
Multiset = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class DisruptionResult:
    """Instances destroyed over ``pairs`` (current -> desired) pairs of one preset's GPU 0."""

    preset: str
    gpu: str
    geometries: int  # valid geometries of the catalog, the empty one included
    pairs: int
    seed: int
    planned: int  # instances destroyed by the plans, summed over the pairs
    clear_and_recreate: int  # ... by mig-parted's clear and re-create
    minimum: int  # ... at the true minimum (brute force)
    at_minimum: int  # pairs where the plan destroyed exactly the minimum
    plan_median_s: float
    plan_p99_s: float

    @property
    def planned_mean(self) -> float:
        return self.planned / self.pairs if self.pairs else 0.0

    @property
    def clear_mean(self) -> float:
        return self.clear_and_recreate / self.pairs if self.pairs else 0.0

    @property
    def minimum_mean(self) -> float:
        return self.minimum / self.pairs if self.pairs else 0.0

    @property
    def ratio(self) -> float:
        """Planned over clear-and-recreate destroyed instances (lower is better)."""
        return self.planned / self.clear_and_recreate if self.clear_and_recreate else 0.0


# --- the catalog, read through the hardware layer ----------------------------------------


@cache
def read_catalog(preset: str) -> tuple[str, Catalog]:
    """(GPU name, catalog) of GPU 0 of a simulated ``preset`` node."""
    with tempfile.TemporaryDirectory() as tmp:
        node = SimulatedNode(preset, Path(tmp) / "state", Path(tmp) / "proc")
        try:
            session = NvmlSession(node.nvml)
            session.call("nvmlInit")
            try:
                handle = session.call("nvmlDeviceGetHandleByIndex", 0)
                static = read_static(session, 0)
                profiles = read_gi_profiles(session, handle, static)
            finally:
                session.call("nvmlShutdown")
                session.close()
        finally:
            node.close()
    return static.name, catalog_of(profiles)


# --- brute force: every valid geometry ---------------------------------------------------


def _disjoint_sets(catalog: Catalog, start: int,
                   used: int) -> Iterator[tuple[tuple[str, Placement], ...]]:
    """Every set of disjoint legal placements on slices ``start``.. not in ``used``: at each
    slice either no instance starts there, or one of any profile that may start there."""
    if start >= catalog.memory_slices:
        yield ()
        return
    yield from _disjoint_sets(catalog, start + 1, used)
    if used >> start & 1:
        return
    for spec in catalog.profiles:
        for p in spec.placements:
            mask = ((1 << p.size) - 1) << p.start
            if p.start == start and not used & mask:
                for rest in _disjoint_sets(catalog, start + 1, used | mask):
                    yield ((spec.name, p), *rest)


def multiset_of(layout: Layout) -> Multiset:
    return tuple(sorted(Counter(name for name, _ in layout).items()))


@cache
def all_geometries(catalog: Catalog) -> tuple[Layout, ...]:
    """Every valid geometry of ``catalog`` (the empty one included), in enumeration order."""
    me = {s.name for s in catalog.profiles if s.media_extensions}
    maxima = {s.name: s.max_instances for s in catalog.profiles}
    out = []
    for found in _disjoint_sets(catalog, 0, 0):
        counts = Counter(name for name, _ in found)
        if all(n <= maxima[name] for name, n in counts.items()) \
                and sum(counts[name] for name in me) <= 1:
            out.append(frozenset(found))
    return tuple(out)


@cache
def geometries_by_multiset(catalog: Catalog) -> dict[Multiset, tuple[Layout, ...]]:
    """The valid geometries grouped by their multiset of profiles."""
    grouped: dict[Multiset, list[Layout]] = {}
    for layout in all_geometries(catalog):
        grouped.setdefault(multiset_of(layout), []).append(layout)
    return {key: tuple(layouts) for key, layouts in grouped.items()}


def minimum_destroyed(catalog: Catalog, current: Layout, wanted: Multiset) -> int:
    """The fewest current instances any valid geometry of ``wanted`` must lose."""
    candidates = geometries_by_multiset(catalog)[wanted]
    return len(current) - max(len(current & layout) for layout in candidates)


# --- the benchmark -----------------------------------------------------------------------


def _p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def run(preset: str, pairs: int = DEFAULT_PAIRS, seed: int = DEFAULT_SEED) -> DisruptionResult:
    """Draw ``pairs`` seeded (current, desired) pairs on ``preset``'s GPU 0 and count the
    instances each approach destroys."""
    gpu, catalog = read_catalog(preset)
    geometries = all_geometries(catalog)
    if len(geometries) < 2:
        raise ValueError(f"{preset}: GPU 0 has fewer than two MIG geometries")
    rng = random.Random(seed)
    planned = clear = minimum = at_minimum = 0
    times: list[float] = []
    for _ in range(pairs):
        i, j = rng.sample(range(len(geometries)), 2)
        current_layout, wanted = geometries[i], multiset_of(geometries[j])
        current = Geometry(mig_enabled=True, instances=tuple(
            Instance(profile=name, placement=p) for name, p in current_layout))
        desired = DesiredProfiles(dict(wanted))

        started = time.perf_counter()
        result = plan(catalog, current, desired)
        times.append(time.perf_counter() - started)

        destroyed = len(result.destroy)
        target = result.target()
        if target.counts() != dict(wanted) or not target.is_valid(catalog):
            raise RuntimeError(f"{preset}: plan {result.summary()} does not reach {desired}")
        least = minimum_destroyed(catalog, current_layout, wanted)
        if destroyed < least:
            raise RuntimeError(f"{preset}: plan {result.summary()} destroys fewer than the "
                               f"brute-force minimum {least}")
        planned += destroyed
        clear += 0 if multiset_of(current_layout) == wanted else len(current_layout)
        minimum += least
        at_minimum += destroyed == least
    return DisruptionResult(
        preset=preset, gpu=gpu, geometries=len(geometries), pairs=pairs, seed=seed,
        planned=planned, clear_and_recreate=clear, minimum=minimum, at_minimum=at_minimum,
        plan_median_s=statistics.median(times) if times else 0.0,
        plan_p99_s=_p99(times) if times else 0.0)


def main(pairs: int = DEFAULT_PAIRS, seed: int = DEFAULT_SEED) -> None:
    cpu = platform.machine()
    print(f"# MIG disruption: instances destroyed over {pairs} seeded (current -> desired) "
          f"pairs per preset, seed {seed}; {os.cpu_count()} CPUs {cpu}, "
          f"Python {platform.python_version()}")
    print(f"{'preset':<18} {'GPU 0':<22} {'geometries':>10} {'pairs':>6} {'planned tot/mean':>17} "
          f"{'clear+recreate tot/mean':>24} {'minimum tot/mean':>17} {'=min':>6} "
          f"{'planned/clear':>13} {'plan ms med':>11} {'plan ms p99':>11}")
    for preset in PRESETS:
        r = run(preset, pairs, seed)
        print(f"{r.preset:<18} {r.gpu:<22} {r.geometries:>10} {r.pairs:>6} "
              f"{f'{r.planned}/{r.planned_mean:.2f}':>17} "
              f"{f'{r.clear_and_recreate}/{r.clear_mean:.2f}':>24} "
              f"{f'{r.minimum}/{r.minimum_mean:.2f}':>17} {r.at_minimum:>6} "
              f"{r.ratio:>13.3f} {r.plan_median_s * 1e3:>11.3f} {r.plan_p99_s * 1e3:>11.3f}")
