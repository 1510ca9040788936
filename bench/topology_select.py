"""Best-set selection: time and quality on synthetic topologies (``make bench``).

Topologies, each for 8, 16, 32 and 64 GPUs:
- ``nvswitch``: every GPU on one NVSwitch fabric (NV18), four GPUs per NUMA node;
- ``bridged``: NVLink bridges (NV12) on pairs 0-1, 2-3, ...; two NUMA nodes, NODE/SYS PCIe;
- ``mixed``: PCIe Gen3/4/5 GPUs under a PCIe tree (PIX pairs, PXB quads, NODE halves, SYS),
  a few NV4/NV12 bridges and NV6 four-GPU meshes, seeded.
Each input is a topology with a random quarter (at most) of its GPUs busy. Time is that of
``agent.topology.select.select`` (the weight matrix included); quality is the bottleneck and
total bandwidth of the chosen set against the optimum (brute force over every subset where
that is cheap, the exact search with no size limit otherwise) and against a go-gpuallocator
style best-effort baseline written from ``reference/topology.md`` 1.2-1.3: additive pair
scores (100 per direct NVLink, which NVSwitch links are not, plus SYS 10, NODE 20, PHB 30,
PXB 40, PIX 50), the best partition of the free GPUs into groups of the requested size while
there are at most ``PARTITION_LIMIT`` partitions, the greedy method vgpu-manager uses beyond.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Iterator, Sequence

from agent.topology.bandwidth import pcie_gb_s
from agent.topology.graph import GpuNode, TopologyGraph
from agent.topology.search import EXACT_LIMIT, choose, count_choices, evaluate, twin_classes
from agent.topology.select import select

SIZES = (8, 16, 32, 64)
COUNTS = (1, 2, 4, 8)
TOPOLOGIES = ("nvswitch", "bridged", "mixed")
TRIALS = 12
BRUTE_FORCE_LIMIT = 60_000
PARTITION_LIMIT = 50_000
_LEVEL_SCORE = {"SYS": 10, "NODE": 20, "PHB": 30, "PXB": 40, "PIX": 50}


def _graph(links: list[list[int]], levels: list[list[str]], numa: list[int],
           pcie: list[float], *, per_link: float = 25.0, switch: bool = False) -> TopologyGraph:
    n = len(numa)
    gpus = tuple(GpuNode(index=i, uuid=f"GPU-{i}", pci_bus_id="", numa_node=numa[i],
                         cpu_affinity="", nvlinks=max(links[i]),
                         nvlink_gb_s=max(links[i]) * per_link, pcie_gb_s=pcie[i])
                 for i in range(n))
    bandwidth = tuple(tuple(0.0 if a == b else (links[a][b] * per_link if links[a][b]
                                                 else min(pcie[a], pcie[b]))
                            for b in range(n)) for a in range(n))
    return TopologyGraph(gpus=gpus, links=tuple(map(tuple, links)),
                         levels=tuple(map(tuple, levels)), bandwidth=bandwidth,
                         notes=("switch",) if switch else ())


def _levels(n: int, numa: list[int], switch_of: list[int], quad_of: list[int]) -> list[list[str]]:
    def level(a: int, b: int) -> str:
        if a == b:
            return "X"
        if switch_of[a] == switch_of[b]:
            return "PIX"
        if quad_of[a] == quad_of[b]:
            return "PXB"
        return "NODE" if numa[a] == numa[b] else "SYS"
    return [[level(a, b) for b in range(n)] for a in range(n)]


def make_topology(kind: str, n: int, seed: int) -> TopologyGraph:
    rng = random.Random(seed)
    links = [[0] * n for _ in range(n)]
    if kind == "nvswitch":
        numa = [i // 4 for i in range(n)]
        for a in range(n):
            for b in range(n):
                if a != b:
                    links[a][b] = 18
        levels = _levels(n, numa, list(range(n)), list(range(n)))
        return _graph(links, levels, numa, [pcie_gb_s(5, 16)] * n, switch=True)
    if kind == "bridged":
        numa = [0 if i < n // 2 else 1 for i in range(n)]
        for a in range(0, n, 2):
            links[a][a + 1] = links[a + 1][a] = 12
        levels = _levels(n, numa, list(range(n)), list(range(n)))
        return _graph(links, levels, numa, [pcie_gb_s(4, 16)] * n)
    numa = [i * 4 // n for i in range(n)]
    switch_of = [i // 2 for i in range(n)]
    quad_of = [i // 4 for i in range(n)]
    pcie = [pcie_gb_s(rng.choice((3, 4, 4, 5)), 16) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    pos = 0
    while pos + 1 < len(order) and pos < n * 2 // 3:
        if rng.random() < 0.4 and pos + 3 < len(order):
            mesh = order[pos:pos + 4]
            for a in mesh:
                for b in mesh:
                    if a != b:
                        links[a][b] = 6
            pos += 4
        else:
            a, b = order[pos], order[pos + 1]
            links[a][b] = links[b][a] = rng.choice((4, 12))
            pos += 2
    return _graph(links, _levels(n, numa, switch_of, quad_of), numa, pcie)


# -- the go-gpuallocator style baseline ------------------------------------------------------


def _pair_score(graph: TopologyGraph, a: int, b: int) -> int:
    """NVLink 100 per link counted only between GPUs (upstream has no NVSwitch handling), plus
    the PCIe level."""
    direct = 0 if graph.notes == ("switch",) else graph.links[a][b]
    return 100 * direct + _LEVEL_SCORE.get(graph.levels[a][b], 0)


def _set_score(graph: TopologyGraph, group: Sequence[int]) -> int:
    return sum(_pair_score(graph, a, b) for x, a in enumerate(group) for b in group[x + 1:])


def _partitions(items: list[int | None], size: int) -> Iterator[list[list[int | None]]]:
    """Every partition of ``items`` into groups of ``size``, the first item pinned into the
    next group; a group holds none or all of the padding (go-gpuallocator's rule)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    total_pads = sum(1 for g in items if g is None)
    for others in itertools.combinations(range(len(rest)), size - 1):
        group = [first, *(rest[i] for i in others)]
        if sum(1 for g in group if g is None) not in (0, total_pads):
            continue
        remaining = [r for i, r in enumerate(rest) if i not in others]
        for tail in _partitions(remaining, size):
            yield [group, *tail]


def partition_count(n: int, size: int) -> int:
    groups = math.ceil(n / size)
    return math.factorial(groups * size) // (math.factorial(size) ** groups
                                              * math.factorial(groups))


def baseline(graph: TopologyGraph, free: list[int], size: int) -> tuple[int, ...]:
    if size == 1:
        return (free[0],)  # every single-device partition scores 0: the first one wins
    if partition_count(len(free), size) <= PARTITION_LIMIT:
        padded: list[int | None] = [*free, *([None] * (-len(free) % size))]
        best: tuple[int, list[list[int | None]]] | None = None
        for partition in _partitions(padded, size):
            score = sum(_set_score(graph, [g for g in group if g is not None])
                        for group in partition if None not in group)
            if best is None or score > best[0]:
                best = (score, partition)
        assert best is not None
        groups = [g for g in best[1] if None not in g]
        chosen = max(groups, key=lambda g: _set_score(graph, [x for x in g if x is not None]))
        return tuple(sorted(x for x in chosen if x is not None))
    seed = max(free, key=lambda a: sum(_pair_score(graph, a, b) for b in free if b != a))
    chosen = [seed]
    while len(chosen) < size:
        chosen.append(max((c for c in free if c not in chosen),
                          key=lambda c: sum(_pair_score(graph, c, a) for a in chosen)))
    return tuple(sorted(chosen))


# -- the optimum -----------------------------------------------------------------------------


def _key(graph: TopologyGraph, members: Sequence[int]) -> tuple[float, float]:
    if len(members) < 2:
        return (math.inf, 0.0)
    pairs = [graph.bandwidth[a][b] for x, a in enumerate(members) for b in members[x + 1:]]
    return (min(pairs), round(sum(pairs), 3))


def optimum(graph: TopologyGraph, free: list[int], size: int) -> tuple[float, float] | None:
    """Best (bottleneck, total): brute force where cheap, else the unbounded exact search."""
    if math.comb(len(free), size) <= BRUTE_FORCE_LIMIT:
        return max(_key(graph, s) for s in itertools.combinations(free, size))
    weights = [[round(graph.bandwidth[a][b] * 1000) for b in free] for a in free]
    numa = [graph.gpus[i].numa_node for i in free]
    classes = [c for c in twin_classes(weights, numa, []) if not c.forced]
    if count_choices([len(c.members) for c in classes], size, cap=10**7) > 2_000_000:
        return None
    choice = choose(weights, numa, size, exact_limit=10**7)
    b, t, _ = evaluate(weights, numa, choice.members)
    return (b / 1000, t / 1000)


def run_case(kind: str, n: int, size: int, trials: int, seed: int) -> dict[str, object]:
    rng = random.Random(f"{kind}-{n}-{size}-{seed}")
    times: list[float] = []
    exact = ours_opt = base_opt = compared = 0
    base_ratio: list[float] = []
    for trial in range(trials):
        graph = make_topology(kind, n, seed * 1000 + trial)
        busy = set(rng.sample(range(n), rng.randint(0, min(n // 4, n - size))))
        free = [i for i in range(n) if i not in busy]
        unavailable = {i: "busy" for i in busy}
        best_time = math.inf
        for _ in range(3):
            started = time.perf_counter()
            chosen = select(graph, size, unavailable=unavailable)
            best_time = min(best_time, time.perf_counter() - started)
        times.append(best_time * 1000)
        exact += chosen.optimal
        if size == 1:
            continue
        best = optimum(graph, free, size)
        if best is None:
            continue
        compared += 1
        ours = _key(graph, chosen.gpus)
        base = _key(graph, baseline(graph, free, size))
        ours_opt += ours == best
        base_opt += base == best
        base_ratio.append(base[0] / best[0])
    return {
        "median": statistics.median(times), "worst": max(times), "exact": exact,
        "trials": trials, "compared": compared, "ours": ours_opt, "base": base_opt,
        "base_bottleneck": statistics.mean(base_ratio) if base_ratio else None,
    }


def main(trials: int = TRIALS, seed: int = 1) -> None:
    cpu = platform.machine()
    print(f"# best-set selection: {trials} inputs per row (random busy GPUs), time = best of 3 "
          f"per input; {os.cpu_count()} CPUs {cpu}, Python {platform.python_version()}; "
          f"exact-search limit {EXACT_LIMIT} class choices")
    header = (f"{'topology':<9} {'GPUs':>4} {'N':>2} {'median ms':>10} {'worst ms':>9} "
              f"{'exact':>6} {'ours=opt':>9} {'base=opt':>9} {'base bottleneck':>16}")
    print(header)
    for kind in TOPOLOGIES:
        for n in SIZES:
            for size in COUNTS:
                row = run_case(kind, n, size, trials, seed)
                compared = row["compared"]
                if size == 1:
                    ours = base = ratio = "-"
                elif not compared:
                    ours = base = ratio = "n/a"
                else:
                    ours = f"{row['ours']}/{compared}"
                    base = f"{row['base']}/{compared}"
                    ratio = f"{100 * float(str(row['base_bottleneck'])):.0f}% of opt"
                print(f"{kind:<9} {n:>4} {size:>2} {row['median']:>10.3f} {row['worst']:>9.3f} "
                      f"{row['exact']:>3}/{row['trials']:<2} {ours:>9} {base:>9} {ratio:>16}")


if __name__ == "__main__":
    main()
