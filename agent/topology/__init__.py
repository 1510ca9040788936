"""The node's GPU interconnect as a pure graph: bandwidths, the ``nvidia-smi topo -m`` matrix,
NVLink islands, and the choice of the best-connected GPU set. No NVML here: the graph is
built from what ``agent/gpu/topology.py`` discovered."""
