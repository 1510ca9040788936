"""Packing of MIG slices made on demand: the fraction of slice requests admitted by the agent's
placement (:func:`agent.claims.placement.choose`) against first-fit and the best achievable.

The catalog is GPU 0's of a simulated ``dgx-h100``, read through the real hardware layer
(:func:`bench.mig_disruption.read_catalog`); every GPU of the node has it.

**Trace.** A seeded stream of slice requests: Poisson arrivals, each with a profile drawn
with ``PROFILE_WEIGHTS`` (many small inference and notebook slices, some half-GPU and
whole-GPU training jobs) and an exponentially distributed lifetime, and a release event at its
end. ``load`` is the offered load in memory slices: arrival rate x mean lifetime x mean memory
slices per request, over the memory slices of the node (1.0 = the node would be exactly full
on average if packing were perfect). Events are replayed in time order; a request that is not
admitted is dropped (no queueing, no retries) and its release is ignored. A placement is
kept for the request's lifetime: MIG instances cannot move.

**Policies.** ``ours``: :func:`choose` over every GPU (keep the most room for the largest
profiles, then best fit). ``first-fit``: the first GPU, then the lowest start, where the
instance fits (legal placement, no overlap, instance limits).

**Best achievable**, by exact search, on small instances: a reduced 2-GPU node and short
traces (``SMALL_ARRIVALS`` requests), many of them. Two optima are computed per trace, both
knowing the whole trace in advance (clairvoyant) and both bound like every policy here to
keep placements for a request's lifetime:

- ``best placement``: must admit every request that fits somewhere when it arrives (as the
  agent must: kubelet asked for it), but chooses each GPU and placement to maximise the
  number admitted over the trace. This is the best any placement rule could do, and the
  reference of the target (``ours`` >= 97% of it);
- ``offline optimum``: may also turn away a request that fits to keep room for later ones;
  an upper bound on any admission policy without migration, shown for scale.

Both are memoised depth-first searches over (event, live instances and where they are), with
the two GPUs' states sorted so symmetric states are searched once.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from agent.claims.placement import Candidate, choose
from agent.gpu.types import Placement
from agent.mig.geometry import Catalog, Geometry, Instance
from bench.mig_disruption import geometries_by_multiset, read_catalog

PRESET = "dgx-h100"
PROFILE_WEIGHTS: dict[str, float] = {
    "1g.10gb": 0.35, "1g.20gb": 0.15, "2g.20gb": 0.18, "3g.40gb": 0.15, "4g.40gb": 0.07,
    "7g.80gb": 0.10,
}
GPUS = 8
ARRIVALS = 1200  # 2 events each: 2400 events
LOAD = 1.0
SMALL_GPUS = 2
SMALL_ARRIVALS = 18
SMALL_TRACES = 150
SMALL_LOAD = 1.2
DEFAULT_SEED = 1
TARGET = 0.97  # ours / best placement

# An event: (time, kind, request id, profile); kind 0 = release, 1 = arrival (releases at the
# same time go first).
Event = tuple[float, int, int, str]
# Where a policy put a request: (gpu, placement).
Spot = tuple[int, Placement]
Policy = Callable[[Catalog, Sequence[Geometry], str], Spot | None]


@dataclass(frozen=True)
class Trace:
    seed: int
    gpus: int
    load: float
    events: tuple[Event, ...]

    @property
    def arrivals(self) -> int:
        return sum(1 for e in self.events if e[1] == 1)


@dataclass(frozen=True)
class Admitted:
    """Requests admitted by one policy over a trace (or a set of traces)."""

    policy: str
    arrivals: int
    admitted: int
    by_profile: tuple[tuple[str, int, int], ...]  # (profile, admitted, arrivals)

    @property
    def fraction(self) -> float:
        return self.admitted / self.arrivals if self.arrivals else 0.0


@dataclass(frozen=True)
class PackingResult:
    seed: int
    gpu: str
    large_gpus: int
    large_events: int
    large_load: float
    large: tuple[Admitted, ...]  # ours, first-fit
    small_gpus: int
    small_traces: int
    small_arrivals: int  # per trace
    small_load: float
    small: tuple[Admitted, ...]  # ours, first-fit, best placement, offline optimum
    seconds: float

    def large_of(self, policy: str) -> Admitted:
        return next(a for a in self.large if a.policy == policy)

    def small_of(self, policy: str) -> Admitted:
        return next(a for a in self.small if a.policy == policy)

    @property
    def ours_vs_best(self) -> float:
        """Admitted by ours over admitted by the best placement, on the small instances."""
        best = self.small_of("best placement").admitted
        return self.small_of("ours").admitted / best if best else 1.0


# --- the trace -----------------------------------------------------------------------------


def mean_memory_slices(catalog: Catalog) -> float:
    total = sum(PROFILE_WEIGHTS.values())
    return sum(w * catalog.profile(p).memory_slices for p, w in PROFILE_WEIGHTS.items()) / total


def make_trace(catalog: Catalog, *, seed: int, gpus: int, arrivals: int, load: float) -> Trace:
    """``arrivals`` requests and their releases; mean lifetime 1, rate set by ``load``."""
    rng = random.Random(seed)
    rate = load * gpus * catalog.memory_slices / mean_memory_slices(catalog)
    profiles, weights = list(PROFILE_WEIGHTS), list(PROFILE_WEIGHTS.values())
    events: list[Event] = []
    now = 0.0
    for request in range(arrivals):
        now += rng.expovariate(rate)
        profile = rng.choices(profiles, weights)[0]
        events.append((now, 1, request, profile))
        events.append((now + rng.expovariate(1.0), 0, request, profile))
    events.sort()
    return Trace(seed=seed, gpus=gpus, load=load, events=tuple(events))


# --- online policies -----------------------------------------------------------------------


def _fits(catalog: Catalog, geometry: Geometry, profile: str, placement: Placement) -> bool:
    after = Geometry(mig_enabled=True,
                     instances=(*geometry.instances, Instance(profile, placement)))
    return after.is_valid(catalog)


def ours(catalog: Catalog, geometries: Sequence[Geometry], profile: str) -> Spot | None:
    choice = choose([Candidate(i, catalog, g) for i, g in enumerate(geometries)], profile)
    return None if choice is None else (choice.index, choice.placement)


def first_fit(catalog: Catalog, geometries: Sequence[Geometry], profile: str) -> Spot | None:
    spec = catalog.profile(profile)
    for index, geometry in enumerate(geometries):
        for placement in sorted(geometry.free_placements(spec), key=lambda p: p.start):
            if _fits(catalog, geometry, profile, placement):
                return index, placement
    return None


POLICIES: dict[str, Policy] = {"ours": ours, "first-fit": first_fit}


def _tally(name: str, trace_admitted: Sequence[tuple[str, bool]]) -> Admitted:
    by: dict[str, list[int]] = {p: [0, 0] for p in PROFILE_WEIGHTS}
    for profile, admitted in trace_admitted:
        by[profile][0] += admitted
        by[profile][1] += 1
    return Admitted(policy=name, arrivals=len(trace_admitted),
                    admitted=sum(a for _, a in trace_admitted),
                    by_profile=tuple((p, a, n) for p, (a, n) in by.items()))


def replay(catalog: Catalog, trace: Trace, policy: Policy) -> list[tuple[str, bool]]:
    """(profile, admitted) per arrival, in order."""
    geometries = [Geometry(mig_enabled=True) for _ in range(trace.gpus)]
    where: dict[int, tuple[int, Instance]] = {}
    out: list[tuple[str, bool]] = []
    for _, kind, request, profile in trace.events:
        if kind == 0:
            if request in where:
                gpu, instance = where.pop(request)
                geometries[gpu] = Geometry(mig_enabled=True, instances=tuple(
                    i for i in geometries[gpu].instances if i is not instance))
            continue
        spot = policy(catalog, geometries, profile)
        if spot is not None:
            gpu, placement = spot
            instance = Instance(profile, placement)
            if not _fits(catalog, geometries[gpu], profile, placement):
                raise RuntimeError(f"policy placed {profile} at {placement} where it does "
                                   "not fit")
            geometries[gpu] = Geometry(mig_enabled=True,
                                       instances=(*geometries[gpu].instances, instance))
            where[request] = (gpu, instance)
        out.append((profile, spot is not None))
    return out


# --- no fragmentation: placements redone at every arrival ---------------------------------


def repacked(catalog: Catalog, trace: Trace) -> list[tuple[str, bool]]:
    """(profile, admitted) per arrival when a request is admitted whenever the live requests
    and it fit on the node together, however placed: as if every instance could be moved at
    no cost at each arrival (MIG instances cannot be; a reference for what fragmentation
    costs, not a policy). Exact: the live multiset is split over the GPUs by search."""
    profiles = tuple(PROFILE_WEIGHTS)
    feasible = sorted({tuple(dict(counts).get(p, 0) for p in profiles)
                       for counts in geometries_by_multiset(catalog)
                       if all(name in profiles for name, _ in counts)}, reverse=True)
    feasible = [f for f in feasible if any(f)]
    largest = sorted(range(len(profiles)), key=lambda i: catalog.profile(profiles[i]).size_key,
                     reverse=True)

    @cache
    def fits(counts: tuple[int, ...], gpus: int) -> bool:
        if not any(counts):
            return True
        if gpus == 0:
            return False
        first = next(i for i in largest if counts[i])  # some GPU holds one of these: GPU 1
        return any(part[first] and all(a <= b for a, b in zip(part, counts, strict=True))
                   and fits(tuple(b - a for a, b in zip(part, counts, strict=True)), gpus - 1)
                   for part in feasible)

    live = [0] * len(profiles)
    admitted: set[int] = set()
    out: list[tuple[str, bool]] = []
    for _, kind, request, profile in trace.events:
        index = profiles.index(profile)
        if kind == 0:
            if request in admitted:
                admitted.remove(request)
                live[index] -= 1
            continue
        live[index] += 1
        if fits(tuple(live), trace.gpus):
            admitted.add(request)
            out.append((profile, True))
        else:
            live[index] -= 1
            out.append((profile, False))
    return out


# --- exact search --------------------------------------------------------------------------

# A GPU's live instances: sorted (request id, profile, start, size).
GpuState = tuple[tuple[int, str, int, int], ...]


def symmetries(catalog: Catalog) -> tuple[dict[tuple[str, int, int], tuple[int, int]], ...]:
    """The permutations of memory slices that map every profile's placements onto its own
    placements (on an H100: swap slices 0-1, 2-3 or 4-5, or the pairs 0-1 and 2-3; 16 in
    all), as (profile, start, size) -> (start, size). Instance limits do not depend on where
    an instance is, so two states one of these maps onto the other have the same futures."""
    slices = catalog.memory_slices
    runs = {spec.name: {frozenset(range(p.start, p.end)): p for p in spec.placements}
            for spec in catalog.profiles}
    found = []
    for perm in itertools.permutations(range(slices)):
        table: dict[tuple[str, int, int], tuple[int, int]] = {}
        for name, placements in runs.items():
            for cells, p in placements.items():
                image = placements.get(frozenset(perm[c] for c in cells))
                if image is None:
                    break
                table[(name, p.start, p.size)] = (image.start, image.size)
            else:
                continue
            break
        else:
            found.append(table)
    return tuple(found)


def _geometry(state: GpuState) -> Geometry:
    return Geometry(mig_enabled=True, instances=tuple(
        Instance(profile, Placement(start, size)) for _, profile, start, size in state))


def optimum(catalog: Catalog, trace: Trace, weights: Mapping[str, int], *,
            lower: int = 0) -> int:
    """The most weight (sum of ``weights[profile]`` over the requests admitted) a clairvoyant
    placement gets out of ``trace``, admitting every request that fits somewhere when it
    arrives. ``lower``: a weight some placement is known to reach (a policy's), which lets
    the search skip what cannot beat it.

    Depth-first branch and bound over (event, live instances on each GPU), memoised. States
    are canonical: each GPU's under the catalog's slice symmetries, and the GPUs sorted. The
    bound on what is still to come sums the future requests that fit, on some GPU, beside the
    current instances still alive then (later admissions only take room away)."""
    events = trace.events
    group = symmetries(catalog)
    released = {request: at for at, kind, request, _ in events if kind == 0}
    arrivals = [(position, at, profile) for position, (at, kind, _, profile)
                in enumerate(events) if kind == 1]
    @cache
    def canonical(state: GpuState) -> GpuState:
        return min(tuple(sorted((r, name, *table[(name, start, size)])
                                for r, name, start, size in state)) for table in group)

    @cache
    def options(state: GpuState, profile: str) -> tuple[tuple[int, int], ...]:
        """(start, size) where ``profile`` fits on a GPU in ``state``."""
        geometry = _geometry(state)
        spec = catalog.profile(profile)
        return tuple((p.start, p.size) for p in geometry.free_placements(spec)
                     if _fits(catalog, geometry, profile, p))

    def bound(position: int, gpus: tuple[GpuState, ...]) -> int:
        return sum(weights[profile] for at_position, at, profile in arrivals
                   if at_position >= position and any(
                       options(tuple(i for i in gpu if released[i[0]] > at), profile)
                       for gpu in gpus))

    exact: dict[tuple[int, tuple[GpuState, ...]], int] = {}
    upper: dict[tuple[int, tuple[GpuState, ...]], int] = {}
    incumbent = lower

    def search(position: int, gpus: tuple[GpuState, ...], gained: int) -> tuple[int, bool]:
        """(value, exact): the most weight still to come from this state, or (not exact) a
        bound on it that cannot lift ``gained`` above the incumbent."""
        nonlocal incumbent
        key = (position, gpus)
        if key in exact:
            incumbent = max(incumbent, gained + exact[key])
            return exact[key], True
        if position == len(events):
            incumbent = max(incumbent, gained)
            exact[key] = 0
            return 0, True
        most = upper.get(key)
        if most is None:
            most = bound(position, gpus)
        if gained + most <= incumbent:
            upper[key] = most
            return most, False
        _, kind, request, profile = events[position]
        children: list[tuple[int, tuple[GpuState, ...]]] = []
        if kind == 0:
            children.append((0, tuple(sorted(canonical(tuple(
                i for i in g if i[0] != request)) for g in gpus))))
        else:
            for index, gpu in enumerate(gpus):
                if index and gpu == gpus[index - 1]:
                    continue  # the same state as the GPU before: the same futures
                for start, size in options(gpu, profile):
                    placed = canonical((*gpu, (request, profile, start, size)))
                    children.append((weights[profile], tuple(sorted(
                        (*gpus[:index], placed, *gpus[index + 1:])))))
            if not children:
                children.append((0, gpus))  # fits nowhere: turned away
        value, all_exact = -1, True
        for gain, child in dict.fromkeys(children):
            found, ok = search(position + 1, child, gained + gain)
            value = max(value, gain + found)
            all_exact = all_exact and ok
        (exact if all_exact else upper)[key] = value
        return value, all_exact

    search(0, tuple(() for _ in range(trace.gpus)), 0)
    return incumbent


# --- the benchmark -------------------------------------------------------------------------


def run(*, seed: int = DEFAULT_SEED, arrivals: int = ARRIVALS, load: float = LOAD,
        small_traces: int = SMALL_TRACES, small_arrivals: int = SMALL_ARRIVALS,
        small_load: float = SMALL_LOAD) -> PackingResult:
    began = time.perf_counter()
    gpu, catalog = read_catalog(PRESET)
    large_trace = make_trace(catalog, seed=seed, gpus=GPUS, arrivals=arrivals, load=load)
    large = tuple(_tally(name, replay(catalog, large_trace, policy))
                  for name, policy in POLICIES.items())
    rng = random.Random(seed)
    small: dict[str, list[tuple[str, bool]]] = {name: [] for name in POLICIES}
    best_placement = offline = 0
    for _ in range(small_traces):
        trace = make_trace(catalog, seed=rng.randrange(1 << 30), gpus=SMALL_GPUS,
                           arrivals=small_arrivals, load=small_load)
        for name, policy in POLICIES.items():
            small[name] += replay(catalog, trace, policy)
        best_placement += optimum(catalog, trace, must_admit=True)
        offline += optimum(catalog, trace, must_admit=False)
    arrived = small_traces * small_arrivals
    small_results = tuple(_tally(name, outcome) for name, outcome in small.items())
    small_results += (Admitted("best placement", arrived, best_placement, ()),
                      Admitted("offline optimum", arrived, offline, ()))
    for result in small_results[:2]:
        if result.admitted > offline:
            raise RuntimeError(f"{result.policy} admitted more than the offline optimum")
    return PackingResult(
        seed=seed, gpu=gpu, large_gpus=GPUS, large_events=len(large_trace.events),
        large_load=load, large=large, small_gpus=SMALL_GPUS, small_traces=small_traces,
        small_arrivals=small_arrivals, small_load=small_load, small=small_results,
        seconds=time.perf_counter() - began)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.2f}%"


def report(r: PackingResult) -> list[str]:
    profiles = list(PROFILE_WEIGHTS)
    lines = [
        f"# Packing: MIG slices made on demand, fraction of requests admitted; seed {r.seed}, "
        f"{r.gpu}; {os.cpu_count()} CPUs {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}",
        f"{r.large_gpus}x H100 trace: {r.large_events} events "
        f"({r.large_of('ours').arrivals} requests and their releases), offered load "
        f"{r.large_load:g}, profile weights "
        + ", ".join(f"{p} {w:g}" for p, w in PROFILE_WEIGHTS.items()),
        f"{'policy':<16} {'admitted':>9} {'fraction':>9} "
        + " ".join(f"{p:>9}" for p in profiles),
    ]
    for a in r.large:
        per = {p: (n_adm, n) for p, n_adm, n in a.by_profile}
        lines.append(f"{a.policy:<16} {a.admitted:>9} {_pct(a.fraction):>9} " + " ".join(
            f"{_pct(per[p][0] / per[p][1]) if per[p][1] else '-':>9}" for p in profiles))
    lines += [
        "",
        f"{r.small_gpus}x H100, exact search: {r.small_traces} traces of {r.small_arrivals} "
        f"requests, offered load {r.small_load:g}",
        f"{'policy':<16} {'admitted':>9} {'fraction':>9} {'vs best placement':>17}",
    ]
    best = r.small_of("best placement").admitted
    for a in r.small:
        lines.append(f"{a.policy:<16} {a.admitted:>9} {_pct(a.fraction):>9} "
                     f"{_pct(a.admitted / best) if best else '-':>17}")
    large_ours, large_ff = r.large_of("ours"), r.large_of("first-fit")
    small_ours, small_ff = r.small_of("ours"), r.small_of("first-fit")
    lines += [
        "",
        "# Targets",
        f"ours / best placement (exact, small instances) = {_pct(r.ours_vs_best)} "
        f"(target >= {_pct(TARGET)}): {'yes' if r.ours_vs_best >= TARGET else 'NO'}",
        f"ours above first-fit: {r.large_gpus}-GPU trace {_pct(large_ours.fraction)} vs "
        f"{_pct(large_ff.fraction)}, small instances {_pct(small_ours.fraction)} vs "
        f"{_pct(small_ff.fraction)}: "
        + ("yes" if large_ours.admitted > large_ff.admitted
           and small_ours.admitted >= small_ff.admitted else "NO"),
        f"({r.seconds:.1f} s)",
    ]
    if math.isnan(r.ours_vs_best):
        lines.append("no request admitted by the best placement")
    return lines


def main(seed: int = DEFAULT_SEED) -> None:
    print("\n".join(report(run(seed=seed))))


if __name__ == "__main__":
    main()
