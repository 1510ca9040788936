"""The link graph: per pair the NVLink count, the PCIe level and the bandwidth; NVLink islands.

Pair bandwidth (GB/s per direction):
- direct NVLinks (bridges, or GPUs wired to each other): links x per-link bandwidth;
- NVSwitch: every pair of switch-attached GPUs gets min(links_a, links_b) x per-link
  bandwidth, the model NCCL and DCGM use (``nvidia-smi topo -m`` prints NV18 for every pair
  of a DGX H100), because the switches forward at full rate between any two ports;
- otherwise PCIe: the slower of the two GPUs' PCIe links.
Link counts are taken from both ends; when they disagree (a link down on one side, a driver
quirk) the smaller is used and the disagreement is reported, never a crash
(k8s-device-plugin #448).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from agent.gpu.topology import NodeLinks, normalise_bus_id
from agent.topology.bandwidth import nvlink_gb_s, pcie_gb_s

log = logging.getLogger("agent.topology")
T = TypeVar("T")

#: ``nvmlGpuTopologyLevel_t`` -> the ``nvidia-smi topo -m`` legend.
LEVEL_NAMES: dict[int, str] = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
#: Order of closeness, nearest first (what the score tie-breaks and the bench use).
LEVEL_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")
UNKNOWN_LEVEL = "SYS"


@dataclass(frozen=True)
class GpuNode:
    index: int
    uuid: str
    pci_bus_id: str
    numa_node: int | None
    cpu_affinity: str
    nvlinks: int
    """Active P2P NVLinks of this GPU (to peers and switches)."""
    nvlink_gb_s: float
    """Its NVLink bandwidth per direction: links x per-link bandwidth (0 without NVLink)."""
    pcie_gb_s: float
    pcie_root: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class TopologyGraph:
    """Everything by GPU index: ``links[a][b]`` NVLinks joining a and b, ``levels[a][b]``
    the PCIe level name, ``bandwidth[a][b]`` GB/s per direction (0 on the diagonal)."""

    gpus: tuple[GpuNode, ...]
    links: tuple[tuple[int, ...], ...]
    levels: tuple[tuple[str, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]
    notes: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.gpus)

    def cell(self, a: int, b: int) -> str:
        """The ``nvidia-smi topo -m`` cell: ``X``, ``NV<n>`` or the PCIe level."""
        if a == b:
            return "X"
        if self.links[a][b]:
            return f"NV{self.links[a][b]}"
        return self.levels[a][b]

    def matrix(self) -> list[list[str]]:
        return [[self.cell(a, b) for b in range(self.size)] for a in range(self.size)]

    def islands(self) -> list[list[int]]:
        """Groups of two or more GPUs joined by NVLink (directly or through switches), by
        lowest index; a GPU without NVLink belongs to none."""
        seen: set[int] = set()
        found: list[list[int]] = []
        for start in range(self.size):
            if start in seen:
                continue
            group, stack = {start}, [start]
            while stack:
                a = stack.pop()
                for b in range(self.size):
                    if b not in group and self.links[a][b]:
                        group.add(b)
                        stack.append(b)
            seen |= group
            if len(group) > 1:
                found.append(sorted(group))
        return found

    def island_of(self) -> dict[int, int]:
        """GPU index -> position of its island in :meth:`islands`."""
        return {gpu: i for i, island in enumerate(self.islands()) for gpu in island}


def build_graph(node: NodeLinks) -> TopologyGraph:
    """The graph of what discovery found (pure)."""
    n = len(node.gpus)
    notes: list[str] = []
    bus_to_index = {normalise_bus_id(g.pci_bus_id): g.index for g in node.gpus}
    direct = [[0] * n for _ in range(n)]
    switch_links = [0] * n
    per_link = [0.0] * n
    gpus: list[GpuNode] = []
    for g in node.gpus:
        p2p = [link for link in g.links if link.p2p]
        for link in p2p:
            if link.remote_type == "switch":
                switch_links[g.index] += 1
            elif link.remote_type == "gpu":
                peer = bus_to_index.get(link.remote_bus_id)
                if peer is not None and peer != g.index:
                    direct[g.index][peer] += 1
        # The slowest link sets the rate (links of one GPU are one generation in practice).
        per_link[g.index] = min((nvlink_gb_s(link.version) for link in p2p), default=0.0)
        gpus.append(GpuNode(
            index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, numa_node=g.numa_node,
            cpu_affinity=g.cpu_affinity, nvlinks=len(p2p),
            nvlink_gb_s=round(len(p2p) * per_link[g.index], 3),
            pcie_gb_s=pcie_gb_s(g.pcie_generation, g.pcie_width), pcie_root=g.pcie_root,
            error=g.error))
    links = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            ab, ba = direct[a][b], direct[b][a]
            if ab != ba:
                note = (f"GPUs {a}-{b}: asymmetric NVLink data ({ab} links seen from GPU {a}, "
                        f"{ba} from GPU {b}); using {min(ab, ba)}")
                notes.append(note)
                log.warning("asymmetric nvlink", extra={"gpus": f"{a}-{b}", "from_a": ab,
                                                        "from_b": ba})
            count = min(ab, ba)
            if switch_links[a] and switch_links[b]:
                count += min(switch_links[a], switch_links[b])
            links[a][b] = links[b][a] = count
    levels = [[UNKNOWN_LEVEL] * n for _ in range(n)]
    for (a, b), level in node.ancestors.items():
        levels[a][b] = levels[b][a] = LEVEL_NAMES.get(level, UNKNOWN_LEVEL)
    for a in range(n):
        levels[a][a] = "X"
    bandwidth = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            if links[a][b]:
                value = links[a][b] * min(per_link[a], per_link[b])
            else:
                value = min(gpus[a].pcie_gb_s, gpus[b].pcie_gb_s)
            bandwidth[a][b] = bandwidth[b][a] = round(value, 3)
    return TopologyGraph(gpus=tuple(gpus), links=_freeze(links), levels=_freeze(levels),
                         bandwidth=_freeze(bandwidth),
                         notes=tuple(notes) + tuple(node.problems))


def graph_from_matrix(links: Sequence[Sequence[int]], levels: Sequence[Sequence[str]],
                      numa: Sequence[int | None], *, nvlink_gb_s_per_link: float = 25.0,
                      pcie: float = 31.5) -> TopologyGraph:
    """A synthetic graph (tests, benchmarks): link counts, PCIe levels and NUMA per GPU."""
    n = len(numa)
    gpus = tuple(GpuNode(index=i, uuid=f"GPU-synthetic-{i}", pci_bus_id="", numa_node=numa[i],
                         cpu_affinity="", nvlinks=max(links[i]),
                         nvlink_gb_s=max(links[i]) * nvlink_gb_s_per_link, pcie_gb_s=pcie)
                 for i in range(n))
    bandwidth = [[0.0 if a == b else
                  (links[a][b] * nvlink_gb_s_per_link if links[a][b] else pcie)
                  for b in range(n)] for a in range(n)]
    fixed_levels = [["X" if a == b else levels[a][b] for b in range(n)] for a in range(n)]
    return TopologyGraph(gpus=gpus, links=_freeze(links), levels=_freeze(fixed_levels),
                         bandwidth=_freeze(bandwidth))


def _freeze(rows: Sequence[Sequence[T]]) -> tuple[tuple[T, ...], ...]:
    return tuple(tuple(row) for row in rows)
