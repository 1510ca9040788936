"""The device nodes the NVIDIA driver creates under /dev, as the simulated node's stand-ins:
plain files under ``<sim>/root/dev`` at the paths a CDI spec names (``/dev/nvidia<minor>``,
``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` and every
``/dev/nvidia-caps/nvidia-cap<N>`` that ``mig-minors`` lists; on a node in an NVLink domain
also the IMEX channels ``/dev/nvidia-caps-imex-channels/channel<N>``, minor N of the
``nvidia-caps-imex-channels`` major in ``/proc/devices``). The agent looks for a claim's
nodes under its device root before answering a prepare; with the simulator that root is
``<sim>/root``, so a test removes a file here to play a node the driver has not created yet."""

from __future__ import annotations

import os
from pathlib import Path

from agent.gpu.sim import procfs

_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
IMEX_CHANNEL_DIR = "dev/nvidia-caps-imex-channels"
#: The channels a simulated node in an NVLink domain has: the driver creates none (an
#: administrator runs mknod, or the driver option creates channel0); 2048 is what NVIDIA's
#: DRA driver publishes, so every channel a domain may be given exists.
IMEX_CHANNELS = 2048


def imex_channel_path(minor: int) -> str:
    """The IMEX channel node with minor ``minor`` (relative to the root)."""
    return f"{IMEX_CHANNEL_DIR}/channel{minor}"


def node_paths(gpu_count: int, *, imex_channels: int = 0) -> list[str]:
    """Every node path (``dev/...``, relative to the root) a driver with ``gpu_count`` GPUs
    provides, capability nodes and ``imex_channels`` IMEX channels included."""
    paths = [f"dev/{name}" for name in _CONTROL]
    paths += [f"dev/nvidia{minor}" for minor in range(gpu_count)]
    minors = (line.split()[1] for line in procfs.mig_minors_text(gpu_count).splitlines())
    paths += [f"dev/nvidia-caps/nvidia-cap{minor}" for minor in minors]
    paths += [imex_channel_path(minor) for minor in range(imex_channels)]
    return paths


def write_nodes(root: Path, *, gpu_count: int, imex_channels: int = 0) -> None:
    """Create the stand-ins once (a marker says they were made: a test that removed one keeps
    it removed across a restart of the simulated node)."""
    marker = root / "dev" / ".gpu-agent-sim"
    if marker.exists():
        return
    (root / "dev" / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    if imex_channels:
        (root / IMEX_CHANNEL_DIR).mkdir(parents=True, exist_ok=True)
    first, *rest = node_paths(gpu_count, imex_channels=imex_channels)
    os.close(os.open(root / first, os.O_WRONLY | os.O_CREAT, 0o666))
    # Hard links to one empty inode: a thousand capability nodes per simulated node cost
    # ~8x less than a thousand inodes, and removing one name still removes only that node.
    for rel in rest:
        if not (root / rel).exists():
            os.link(root / first, root / rel)
    marker.touch()
