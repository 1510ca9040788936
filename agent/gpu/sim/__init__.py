"""A simulated NVIDIA GPU node: the ``pynvml`` call surface over durable fake hardware.

``SimulatedNode(preset, state_dir, proc_root).nvml`` is what the hardware layer is given
instead of the ``pynvml`` module; the node's other methods are the simulation controls.

The names below load on first use: the simulated driver tools (``nvidia-smi``,
``nvidia-cuda-mps-control``, ``nvidia-imex``, ``nvidia-imex-ctl``) are modules of this
package and start as fresh processes, so importing the package must not import NVML and the
node.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.gpu.sim.node import SimulatedNode
    from agent.gpu.sim.nvml import SimulatedNvml
    from agent.gpu.sim.presets import PRESETS, preset_names

__all__ = ["PRESETS", "SimulatedNode", "SimulatedNvml", "preset_names"]

_HOMES = {"SimulatedNode": "agent.gpu.sim.node", "SimulatedNvml": "agent.gpu.sim.nvml",
          "PRESETS": "agent.gpu.sim.presets", "preset_names": "agent.gpu.sim.presets"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
