"""The simulated node's interconnect: NVLink wiring (to NVSwitches or through bridges), the
PCIe tree the common-ancestor call walks, P2P capabilities and the fabric (multi-node NVLink)
state, derived from the preset. Pure functions of the preset; the NVML facade asks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

from agent.gpu.sim.presets import Preset


@dataclass(frozen=True)
class LinkEnd:
    """Where one NVLink of a GPU goes: a GPU (bridge) or an NVSwitch, by PCI bus number."""

    remote_bus: int
    remote_type: int
    remote_gpu: int | None = None


def link_count(preset: Preset) -> int:
    """NVLinks each GPU has wired (0 where there is no NVLink at all)."""
    if preset.nvswitch:
        return len(preset.switch_of_link)
    if preset.nvlink_bridges:
        return preset.gpu.nvlinks
    return 0


def bridge_peer(preset: Preset, index: int) -> int | None:
    for a, b in preset.nvlink_bridges:
        if index in (a, b):
            return b if index == a else a
    return None


def link_end(preset: Preset, index: int, link: int) -> LinkEnd | None:
    """The remote end of link ``link`` of GPU ``index``; None for a link that is not wired."""
    if not 0 <= link < link_count(preset):
        return None
    if preset.nvswitch:
        return LinkEnd(remote_bus=preset.switch_bus_numbers[preset.switch_of_link[link]],
                       remote_type=pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
    peer = bridge_peer(preset, index)
    if peer is None:
        return None
    return LinkEnd(remote_bus=preset.bus_numbers[peer],
                   remote_type=pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, remote_gpu=peer)


def nvlinked(preset: Preset, a: int, b: int) -> bool:
    """Whether NVLink joins GPUs ``a`` and ``b`` (through the switches or a bridge)."""
    if a == b:
        return False
    if preset.nvswitch:
        return True
    return bridge_peer(preset, a) == b


def common_ancestor(preset: Preset, a: int, b: int) -> int:
    """``nvmlGpuTopologyLevel_t`` of the closest PCIe ancestor of two different GPUs."""
    switches = preset.pcie_switches
    if switches and switches[a] == switches[b]:
        return int(pynvml.NVML_TOPOLOGY_MULTIPLE)
    if preset.numa_nodes[a] == preset.numa_nodes[b]:
        return int(pynvml.NVML_TOPOLOGY_NODE)
    return int(pynvml.NVML_TOPOLOGY_SYSTEM)


def p2p_status(preset: Preset, a: int, b: int, index: int) -> int:
    """``nvmlGpuP2PStatus_t`` for a capability index: NVLink gives every capability; PCIe
    gives read/write (and the PCI index) below the inter-socket link, never atomics."""
    linked = nvlinked(preset, a, b)
    if index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
        return int(pynvml.NVML_P2P_STATUS_OK if linked else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)
    if linked:
        return int(pynvml.NVML_P2P_STATUS_OK)
    if index == pynvml.NVML_P2P_CAPS_INDEX_ATOMICS:
        return int(pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)
    if common_ancestor(preset, a, b) >= pynvml.NVML_TOPOLOGY_SYSTEM:
        return int(pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED)
    return int(pynvml.NVML_P2P_STATUS_OK)


#: What the fabric fault control can make a GPU's fabric report: ``completed`` (healthy),
#: ``not-started`` and ``in-progress`` (the fabric manager has not finished registering the
#: GPU), ``failed`` (registration completed with an error status) and ``degraded``
#: (completed, with degraded bandwidth in the health mask).
FABRIC_CONDITIONS = ("completed", "not-started", "in-progress", "failed", "degraded")
#: The status a ``failed`` fabric reports unless told otherwise (a broken GB200 node in the
#: field: ``Status: Insufficient Resources``, clique 0, zero UUID; topology.md 2.5).
DEFAULT_FABRIC_FAILURE = int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
# The 2-bit health fields answer FALSE where the GPU can tell (Blackwell), NOT_SUPPORTED (0)
# on Hopper; the incorrect-configuration field answers NONE.
_HEALTHY_MASK = (
    pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
    | pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_FALSE
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY
    | pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_FALSE
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY
    | pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY_FALSE
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY
    | pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION)
_DEGRADED_BW_FIELD = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW \
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
_DEGRADED_BW_TRUE = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE \
    << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW


@dataclass(frozen=True)
class FabricAnswer:
    """What ``nvmlDeviceGetGpuFabricInfo(V)`` fills in for one GPU."""

    cluster_uuid: str | None
    """None: the zero UUID (no multi-node NVLink, or registration not done)."""
    clique_id: int
    state: int
    status: int
    health_mask: int
    health_summary: int


def fabric_answer(preset: Preset, condition: str, failure: int) -> FabricAnswer:
    """The fabric info of a GPU of a fabric-capable preset in the given condition. Until the
    fabric manager has registered the GPU (or when registration failed) the driver knows no
    cluster or clique: zero UUID, clique 0."""
    blackwell = preset.gpu.architecture == "blackwell"
    healthy = _HEALTHY_MASK if blackwell else 0
    degraded = (healthy & ~_DEGRADED_BW_FIELD) | _DEGRADED_BW_TRUE
    summary = (pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY if blackwell
               else pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED)
    uuid, clique = preset.fabric if preset.fabric else (None, 0)
    if condition in ("not-started", "in-progress"):
        state = (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED if condition == "not-started"
                 else pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
        return FabricAnswer(None, 0, int(state), int(pynvml.NVML_SUCCESS), healthy,
                            int(summary))
    completed = int(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
    if condition == "failed":
        return FabricAnswer(None, 0, completed, failure, healthy,
                            int(pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY))
    if condition == "degraded":
        return FabricAnswer(uuid, clique, completed, int(pynvml.NVML_SUCCESS),
                            degraded,
                            int(pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY))
    return FabricAnswer(uuid, clique, completed, int(pynvml.NVML_SUCCESS), healthy, int(summary))
