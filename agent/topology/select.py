"""Best-connected GPU sets on a :class:`TopologyGraph` (pure): which GPUs may be chosen, the
search (``search.py`` holds the objective), and an answer that explains itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.errors import InvalidRequest, SelectionUnsatisfiable
from agent.topology.graph import TopologyGraph
from agent.topology.search import Choice, choose


@dataclass(frozen=True)
class Selection:
    gpus: tuple[int, ...]
    uuids: tuple[str, ...]
    bottleneck_gb_s: float | None
    """Smallest pair bandwidth in the set; None for one GPU."""
    bottleneck_link: str | None
    """``nvlink`` or ``pcie``: what carries the slowest pair; None for one GPU."""
    total_gb_s: float
    numa_nodes: tuple[int, ...]
    optimal: bool
    method: str
    candidates: int
    excluded: dict[int, str]
    explanation: str


def _units(gb_s: float) -> int:
    """Bandwidths compare as integer MB/s, so sums are exact and ties are real ties."""
    return round(gb_s * 1000)


def select(graph: TopologyGraph, count: int, *, candidates: Sequence[int] | None = None,
           must_include: Sequence[int] = (),
           unavailable: Mapping[int, str] | None = None) -> Selection:
    """The best ``count`` GPUs (by index) among ``candidates`` (default: all), with every GPU
    of ``must_include``; GPUs in ``unavailable`` (index -> reason) are never chosen."""
    unavailable = dict(unavailable or {})
    pool = sorted(set(range(graph.size) if candidates is None else candidates))
    must = sorted(set(must_include))
    for field, refs in (("candidates", pool), ("must_include", must)):
        bad = [i for i in refs if not 0 <= i < graph.size]
        if bad:
            raise InvalidRequest(f"{field}: no GPU {bad[0]} on this node",
                                 errors=[{"field": field, "reason": f"unknown GPU {bad[0]}"}])
    if len(must) > count:
        raise InvalidRequest(f"must_include names {len(must)} GPUs but count is {count}",
                             errors=[{"field": "must_include", "reason": "more GPUs than count"}])
    blocked = [i for i in must if i in unavailable]
    if blocked:
        reasons = "; ".join(f"GPU {i}: {unavailable[i]}" for i in blocked)
        raise SelectionUnsatisfiable(
            f"must_include names GPUs that cannot be chosen ({reasons})", gpus=blocked)
    if candidates is not None:
        outside = [i for i in must if i not in pool]
        if outside:
            raise InvalidRequest(f"must_include GPU {outside[0]} is not among the candidates",
                                 errors=[{"field": "must_include",
                                          "reason": "not among the candidates"}])
    excluded = {i: unavailable[i] for i in pool if i in unavailable}
    usable = [i for i in pool if i not in unavailable]
    if count > len(usable):
        why = "; ".join(f"GPU {i}: {r}" for i, r in sorted(excluded.items()))
        raise SelectionUnsatisfiable(
            f"{count} GPUs asked for but only {len(usable)} can be chosen"
            + (f" ({why})" if why else ""), available=usable, excluded=excluded)
    position = {gpu: p for p, gpu in enumerate(usable)}
    weights = [[_units(graph.bandwidth[a][b]) if a != b else 0 for b in usable] for a in usable]
    numa = [graph.gpus[i].numa_node for i in usable]
    choice = choose(weights, numa, count, [position[i] for i in must])
    return _answer(graph, usable, choice, must, excluded)


def _answer(graph: TopologyGraph, usable: list[int], choice: Choice, must: list[int],
            excluded: dict[int, str]) -> Selection:
    gpus = tuple(usable[p] for p in choice.members)
    numa = tuple(sorted({n for i in gpus if (n := graph.gpus[i].numa_node) is not None}))
    total = round(sum(graph.bandwidth[a][b] for x, a in enumerate(gpus) for b in gpus[x + 1:]),
                  3)
    parts = [f"Chose GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))} "
             f"({choice.method} search over {len(usable)} candidate GPUs"
             f"{'' if choice.optimal else '; may not be optimal'})."]
    bottleneck: float | None = None
    link: str | None = None
    if len(gpus) > 1:
        pair = min(((a, b) for x, a in enumerate(gpus) for b in gpus[x + 1:]),
                   key=lambda p: (graph.bandwidth[p[0]][p[1]], p))
        bottleneck = graph.bandwidth[pair[0]][pair[1]]
        cell = graph.cell(*pair)
        link = "nvlink" if cell.startswith("NV") else "pcie"
        over = "NVLink" if link == "nvlink" else "PCIe"
        parts.append(f"Bottleneck {bottleneck:g} GB/s per direction over {over} ({cell} "
                     f"between GPUs {pair[0]} and {pair[1]}); total {total:g} GB/s.")
        if link == "pcie":
            parts.append(_why_pcie(graph, gpus, must, excluded))
    else:
        parts.append("One GPU: chosen to leave the best-connected GPUs free for larger sets.")
    if numa:
        parts.append(f"NUMA node{'s' if len(numa) > 1 else ''} {', '.join(map(str, numa))}.")
    if excluded:
        parts.append("Not considered: " + "; ".join(
            f"GPU {i} ({reason})" for i, reason in sorted(excluded.items())) + ".")
    return Selection(gpus=gpus, uuids=tuple(graph.gpus[i].uuid for i in gpus),
                     bottleneck_gb_s=bottleneck, bottleneck_link=link, total_gb_s=total,
                     numa_nodes=numa, optimal=choice.optimal, method=choice.method,
                     candidates=len(usable), excluded=excluded, explanation=" ".join(parts))


def _why_pcie(graph: TopologyGraph, gpus: tuple[int, ...], must: list[int],
              excluded: dict[int, str]) -> str:
    anchor = f" including GPU{'s' if len(must) > 1 else ''} {', '.join(map(str, must))}" \
        if must else ""
    peers = sorted({b for a in (must or gpus) for b in range(graph.size)
                    if graph.links[a][b] and b in excluded})
    text = f"No set of {len(gpus)} GPUs{anchor} joined by NVLink throughout is available"
    if peers:
        text += ("; NVLink peers left out: "
                 + ", ".join(f"GPU {p} ({excluded[p]})" for p in peers))
    return text + "."
