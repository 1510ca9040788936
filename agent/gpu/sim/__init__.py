"""A simulated NVIDIA GPU node: the ``pynvml`` call surface over durable fake hardware.

``SimulatedNode(preset, state_dir, proc_root).nvml`` is what the hardware layer is given
instead of the ``pynvml`` module; the node's other methods are the simulation controls.
"""

from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.nvml import SimulatedNvml
from agent.gpu.sim.presets import PRESETS, preset_names

__all__ = ["PRESETS", "SimulatedNode", "SimulatedNvml", "preset_names"]
