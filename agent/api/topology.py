"""Topology endpoints: the link matrix, pair bandwidths, islands and affinities; best sets."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import BaseModel, Field

from agent.api.body import parse_body
from agent.api.context import AGENT, AgentContext
from agent.api.models import OneOf, Strict
from agent.api.node import require_ready
from agent.api.routing import Route, json_response
from agent.device_names import ascii_integer
from agent.errors import InvalidRequest, NotReady
from agent.topology.graph import TopologyGraph
from agent.topology.select import Selection, select
from agent.topology.service import TopologyService

GpuRef = Annotated[int | str, OneOf("a GPU index (a whole number) or UUID (a string)")]


class TopologyGpuModel(BaseModel):
    index: int
    uuid: str
    pci_bus_id: str
    numa_node: int | None = Field(description="NUMA node of the CPUs near this GPU")
    cpu_affinity: str = Field(description="CPUs near this GPU, as a Linux cpulist")
    nvlinks: int = Field(description="Active P2P NVLinks (to peers and NVSwitches)")
    nvlink_gb_s: float = Field(description="NVLink bandwidth, GB/s per direction")
    pcie_gb_s: float = Field(description="PCIe link bandwidth, GB/s per direction")
    pcie_root: str | None
    fabric_clique: str | None = Field(
        description="'<cluster UUID>.<clique id>' of a multi-node NVLink domain, from the "
                    "fabric as last read; null while it is not usable")
    unavailable: str | None = Field(description="Why it cannot be chosen now, if it cannot")
    error: str | None = Field(description="Why discovery has no data for it, if it has none")


class PairModel(BaseModel):
    gpus: tuple[int, int]
    link: str = Field(description="The topo -m cell: NV<n> or a PCIe level")
    nvlinks: int
    bandwidth_gb_s: float = Field(description="GB/s per direction")


class TopologyModel(BaseModel):
    gpus: list[TopologyGpuModel]
    matrix: list[list[str]] = Field(
        description="nvidia-smi topo -m cells in GPU index order: X, NV<n>, PIX, PXB, PHB, "
                    "NODE, SYS")
    pairs: list[PairModel]
    islands: list[list[int]] = Field(description="GPU indices joined by NVLink, per island")
    notes: list[str] = Field(description="What discovery could not read or found asymmetric")


class SelectRequest(Strict):
    count: int = Field(ge=1, le=1024, description="How many GPUs")
    candidates: list[GpuRef] | None = Field(
        default=None, max_length=1024, description="Choose only among these (index or UUID)")
    must_include: list[GpuRef] = Field(default_factory=list, max_length=1024,
                                       description="GPUs the set must contain")


class ExcludedModel(BaseModel):
    gpu: int
    reason: str


class SelectionModel(BaseModel):
    gpus: list[int]
    uuids: list[str]
    bottleneck_gb_s: float | None = Field(
        description="Smallest pair bandwidth in the set (GB/s per direction); null for one GPU")
    bottleneck_link: str | None = Field(description="nvlink or pcie; null for one GPU")
    total_gb_s: float = Field(description="Sum of the pair bandwidths in the set")
    numa_nodes: list[int]
    optimal: bool = Field(description="False when a heuristic answered (very large nodes)")
    method: str
    candidates: int = Field(description="GPUs the search could choose from")
    excluded: list[ExcludedModel]
    explanation: str

    @classmethod
    def of(cls, s: Selection) -> SelectionModel:
        return cls(gpus=list(s.gpus), uuids=list(s.uuids), bottleneck_gb_s=s.bottleneck_gb_s,
                   bottleneck_link=s.bottleneck_link, total_gb_s=s.total_gb_s,
                   numa_nodes=list(s.numa_nodes), optimal=s.optimal, method=s.method,
                   candidates=s.candidates,
                   excluded=[ExcludedModel(gpu=i, reason=r) for i, r in s.excluded.items()],
                   explanation=s.explanation)


def _service(ctx: AgentContext) -> TopologyService:
    require_ready(ctx)
    if not ctx.node.topology.loaded:
        raise NotReady("topology not discovered yet")
    return ctx.node.topology


def topology_model(graph: TopologyGraph, unavailable: dict[int, str],
                   cliques: dict[int, str | None]) -> TopologyModel:
    """The graph as the API shows it; ``cliques`` are the GPUs' fabric cliques as last read
    (the start-up walk's go stale when a fabric changes)."""
    n = graph.size
    return TopologyModel(
        gpus=[TopologyGpuModel(
            index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, numa_node=g.numa_node,
            cpu_affinity=g.cpu_affinity, nvlinks=g.nvlinks, nvlink_gb_s=g.nvlink_gb_s,
            pcie_gb_s=g.pcie_gb_s, pcie_root=g.pcie_root, fabric_clique=cliques.get(g.index),
            unavailable=unavailable.get(g.index), error=g.error) for g in graph.gpus],
        matrix=graph.matrix(),
        pairs=[PairModel(gpus=(a, b), link=graph.cell(a, b), nvlinks=graph.links[a][b],
                         bandwidth_gb_s=graph.bandwidth[a][b])
               for a in range(n) for b in range(a + 1, n)],
        islands=graph.islands(),
        notes=list(graph.notes))


async def get_topology(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    service = _service(ctx)
    gpus = await ctx.node.inventory.refresh()
    cliques = {g.index: g.fabric.clique if g.fabric else None for g in gpus}
    return json_response(topology_model(service.graph, service.unavailable(gpus), cliques))


def _resolve(graph: TopologyGraph, refs: list[GpuRef], field: str) -> list[int]:
    found = []
    for ref in refs:
        text = str(ref)
        match = next((g.index for g in graph.gpus
                      if text == g.uuid or ascii_integer(text) == g.index), None)
        if match is None:
            raise InvalidRequest(f"{field}: no GPU {ref!r} on this node (an index "
                                 f"0-{graph.size - 1} or a GPU UUID)",
                                 errors=[{"field": field, "reason": f"unknown GPU {ref!r}"}])
        found.append(match)
    return found


async def select_gpus(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    service = _service(ctx)
    body = await parse_body(request, SelectRequest)
    graph = service.graph
    candidates = (None if body.candidates is None
                  else _resolve(graph, body.candidates, "candidates"))
    must = _resolve(graph, body.must_include, "must_include")
    gpus = await ctx.node.inventory.refresh()
    selection = select(graph, body.count, candidates=candidates, must_include=must,
                       unavailable=service.unavailable(gpus))
    return json_response(SelectionModel.of(selection))


ROUTES = [
    Route("GET", "/v1/topology", get_topology,
          "NVLink/PCIe matrix (nvidia-smi topo -m cells), pair bandwidths, NVLink islands, "
          "NUMA and CPU affinity", TopologyModel, tag="topology", errors=(503,)),
    Route("POST", "/v1/topology/select", select_gpus,
          "The best-connected set of N GPUs: maximal bottleneck bandwidth, then total, then "
          "NUMA locality, then what stays free", SelectionModel, body=SelectRequest,
          tag="topology", errors=(409, 503), changes_nothing=True, reconciled=True),
]
