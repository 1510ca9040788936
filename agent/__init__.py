"""gpu-node-agent: the per-node agent that owns a node's NVIDIA GPUs for the cluster."""

__version__ = "0.2.0"
