"""``nvidia-smi topo -m`` as text: the GPU matrix, then CPU Affinity, NUMA Affinity and GPU
NUMA ID columns, then the legend (``reference/topology.md`` 3). Works from plain values so
the CLI can print what ``GET /v1/topology`` returned."""

from __future__ import annotations

from collections.abc import Sequence

LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""  # noqa: E501 - nvidia-smi's own lines


def render(matrix: Sequence[Sequence[str]], cpu_affinity: Sequence[str],
           numa_affinity: Sequence[int | None], *, legend: bool = True) -> str:
    """The matrix as ``nvidia-smi topo -m`` prints it (tab-separated columns)."""
    n = len(matrix)
    header = ["", *(f"GPU{i}" for i in range(n)), "CPU Affinity", "NUMA Affinity",
              "GPU NUMA ID"]
    lines = ["\t".join(header)]
    for i, row in enumerate(matrix):
        cells = [f" {c} " if c == "X" else c for c in row]
        numa = "N/A" if numa_affinity[i] is None else str(numa_affinity[i])
        lines.append("\t".join([f"GPU{i}", *cells, cpu_affinity[i] or "N/A", numa, "N/A"]))
    text = "\n".join(lines)
    return f"{text}\n\n{LEGEND}" if legend else text
