"""The device nodes the NVIDIA driver creates under /dev, as the simulated node's stand-ins:
plain files under ``<sim>/root/dev`` at the paths a CDI spec names (``/dev/nvidia<minor>``,
``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` and every
``/dev/nvidia-caps/nvidia-cap<N>`` that ``mig-minors`` lists). The agent looks for a claim's
nodes under its device root before answering a prepare; with the simulator that root is
``<sim>/root``, so a test removes a file here to play a node the driver has not created yet."""

from __future__ import annotations

import os
from pathlib import Path

from agent.gpu.sim import procfs

_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def node_paths(gpu_count: int) -> list[str]:
    """Every node path (``dev/...``, relative to the root) a driver with ``gpu_count`` GPUs
    provides, capability nodes included."""
    paths = [f"dev/{name}" for name in _CONTROL]
    paths += [f"dev/nvidia{minor}" for minor in range(gpu_count)]
    minors = (line.split()[1] for line in procfs.mig_minors_text(gpu_count).splitlines())
    paths += [f"dev/nvidia-caps/nvidia-cap{minor}" for minor in minors]
    return paths


def write_nodes(root: Path, *, gpu_count: int) -> None:
    """Create the stand-ins once (a marker says they were made: a test that removed one keeps
    it removed across a restart of the simulated node)."""
    marker = root / "dev" / ".gpu-agent-sim"
    if marker.exists():
        return
    (root / "dev" / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    first, *rest = node_paths(gpu_count)
    os.close(os.open(root / first, os.O_WRONLY | os.O_CREAT, 0o666))
    # Hard links to one empty inode: a thousand capability nodes per simulated node cost
    # ~8x less than a thousand inodes, and removing one name still removes only that node.
    for rel in rest:
        if not (root / rel).exists():
            os.link(root / first, root / rel)
    marker.touch()
