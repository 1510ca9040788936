"""Discovering how the node's GPUs are wired, through NVML only (never ``nvidia-smi topo``).

Per GPU, each NVLink's state, version, P2P capability, remote device type and remote PCI bus
id; the PCIe link generation and width; the PCIe root from sysfs. (The fabric, multi-node
NVLink, changes while the agent runs: the inventory reads it, ``agent/gpu/fabric.py``.)
Per pair, the PCIe common-ancestor level. N x 36 link calls plus N^2/2 ancestor calls, done
once at start-up (``topology.md`` 5: the device plugin's per-request link walks took
16-30 s).

Robust to what real nodes do: a link answering NOT_SUPPORTED, INVALID_ARGUMENT or
GPU_IS_LOST is skipped; any other error on one link skips that link and is reported; a lost
GPU loses only its own data. The values here are raw facts; ``agent/topology/`` turns them
into bandwidths, the matrix and islands.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from agent.errors import GpuLost, NvmlError
from agent.gpu.session import NvmlSession
from agent.gpu.types import GpuStatic

log = logging.getLogger("agent.gpu.topology")

RemoteType = Literal["gpu", "switch", "ibmnpu", "unknown"]
_REMOTE_TYPES: dict[int, RemoteType] = {0x00: "gpu", 0x01: "ibmnpu", 0x02: "switch"}
# Answers that mean "this link (or call) is not there", not "something broke".
_ABSENT = frozenset({"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT",
                     "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_FOUND"})
_FEATURE_ENABLED = 1
_NVLINK_CAP_P2P_SUPPORTED = 0


@dataclass(frozen=True)
class NvLink:
    """One active NVLink of a GPU."""

    link: int
    version: int
    """``nvmlNvlinkVersion_t`` (1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0,
    8 = 6.0); 0 when the GPU did not say."""
    p2p: bool
    remote_type: RemoteType
    remote_bus_id: str
    """The remote end's PCI bus id in NVML's form, or "" (NVSwitches are not asked)."""


@dataclass(frozen=True)
class GpuLinks:
    """What discovery learned about one GPU; ``error`` says why its data are missing."""

    index: int
    uuid: str
    pci_bus_id: str
    numa_node: int | None
    cpu_affinity: str
    links: tuple[NvLink, ...] = ()
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_root: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class NodeLinks:
    """Discovery's result for the node: per GPU (in index order) and per pair."""

    gpus: tuple[GpuLinks, ...]
    ancestors: dict[tuple[int, int], int] = field(default_factory=dict)
    """``nvmlGpuTopologyLevel_t`` by GPU index pair (lower index first)."""
    problems: tuple[str, ...] = ()
    """Links or pairs that could not be read, for the log and the API."""


def normalise_bus_id(text: str) -> str:
    """A PCI bus id as NVML prints it (``00000000:1B:00.0``), from any common spelling."""
    try:
        domain, bus, rest = text.strip().lower().split(":")
        device, function = rest.split(".")
        return (f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}."
                f"{int(function, 16)}")
    except ValueError:
        return ""


def sysfs_bus_id(bus_id: str) -> str:
    """``0000:1b:00.0``: the spelling sysfs uses (4-digit domain, lower case)."""
    domain, rest = normalise_bus_id(bus_id).split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def pcie_root(sys_root: Path, bus_id: str) -> str | None:
    """``pci<domain>:<bus>``: the PCIe root complex above a device, read from where its
    ``/sys/bus/pci/devices/<BDF>`` link points (``/sys/devices/pci0000:17/...``)."""
    if not normalise_bus_id(bus_id):
        return None
    link = sys_root / "bus" / "pci" / "devices" / sysfs_bus_id(bus_id)
    try:
        target = os.readlink(link)
    except OSError:
        return None
    for part in Path(target).parts:
        if part.startswith("pci") and ":" in part:
            return part
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _GpuWalk:
    """Reads one GPU's links; stops at the first GPU_IS_LOST (the session marks it lost)."""

    def __init__(self, session: NvmlSession, static: GpuStatic, handle: Any,
                 gpu_buses: set[str]) -> None:
        self.session = session
        self.static = static
        self.handle = handle
        self.gpu_buses = gpu_buses
        self.problems: list[str] = []

    def _call(self, function: str, *args: Any) -> Any:
        return self.session.call(function, self.handle, *args, gpu=self.static.uuid)

    def optional(self, function: str, *args: Any) -> Any:
        """A call whose absence is normal; None then. GPU_IS_LOST propagates."""
        try:
            return self._call(function, *args)
        except GpuLost:
            raise
        except NvmlError as err:
            if err.name not in _ABSENT:
                self.problems.append(f"GPU {self.static.index}: {err.detail}")
            return None

    def link(self, link: int) -> NvLink | None:
        state = self.optional("nvmlDeviceGetNvLinkState", link)
        if state is None or int(state) != _FEATURE_ENABLED:
            return None
        version = self.optional("nvmlDeviceGetNvLinkVersion", link)
        p2p = self.optional("nvmlDeviceGetNvLinkCapability", link, _NVLINK_CAP_P2P_SUPPORTED)
        raw_type = self.optional("nvmlDeviceGetNvLinkRemoteDeviceType", link)
        remote_type: RemoteType = ("unknown" if raw_type is None
                                   else _REMOTE_TYPES.get(int(raw_type), "unknown"))
        bus = ""
        if remote_type != "switch":
            # Never ask an NVSwitch link for its remote PCI info: on some systems that call
            # fails, and NCCL once lost all 18 links of a GPU to it (topology.md 2.2).
            info = self.optional("nvmlDeviceGetNvLinkRemotePciInfo", link)
            bus = normalise_bus_id(_text(info.busId)) if info is not None else ""
            if remote_type == "unknown":
                # Older drivers lack the type call: a remote end that is no GPU of this node
                # (or has no visible address, as in a VM) is a switch, as NCCL assumes.
                remote_type = "gpu" if bus in self.gpu_buses else "switch"
        return NvLink(link=link, version=int(version or 0), p2p=bool(p2p),
                      remote_type=remote_type, remote_bus_id=bus)



def read_gpu_links(session: NvmlSession, static: GpuStatic, gpu_buses: set[str], *,
                   sys_root: Path) -> tuple[GpuLinks, Any, list[str]]:
    """One GPU's links (in a worker thread); also its handle (None if lost) and problems."""
    base = GpuLinks(index=static.index, uuid=static.uuid, pci_bus_id=static.pci_bus_id,
                    numa_node=static.numa_node, cpu_affinity=static.cpu_affinity,
                    pcie_root=pcie_root(sys_root, static.pci_bus_id))
    lost = session.lost_reason(static.uuid)
    if static.minor < 0 or lost is not None:
        return _with(base, error=f"GPU is lost: {lost or 'no handle at start-up'}"), None, []
    walk: _GpuWalk | None = None
    try:
        handle = session.call("nvmlDeviceGetHandleByUUID", static.uuid, gpu=static.uuid)
        walk = _GpuWalk(session, static, handle, gpu_buses)
        found = []
        for link in range(int(session.nvml.NVML_NVLINK_MAX_LINKS)):
            nvlink = walk.link(link)
            if nvlink is not None:
                found.append(nvlink)
        generation = walk.optional("nvmlDeviceGetMaxPcieLinkGeneration")
        width = walk.optional("nvmlDeviceGetMaxPcieLinkWidth")
    except GpuLost as err:
        return (_with(base, error=f"GPU is lost: {err.detail}"), None,
                walk.problems if walk else [])
    except NvmlError as err:
        return _with(base, error=err.detail), None, walk.problems if walk else []
    return (_with(base, links=tuple(found),
                  pcie_generation=None if generation is None else int(generation),
                  pcie_width=None if width is None else int(width)),
            handle, walk.problems)


def _with(base: GpuLinks, **changes: Any) -> GpuLinks:
    return replace(base, **changes)


def read_node_links(session: NvmlSession, statics: Sequence[GpuStatic], *,
                    sys_root: Path = Path("/sys")) -> NodeLinks:
    """Discover every GPU's links and every pair's common PCIe ancestor (worker thread)."""
    gpu_buses = {normalise_bus_id(s.pci_bus_id) for s in statics if s.pci_bus_id}
    gpus: list[GpuLinks] = []
    handles: dict[int, Any] = {}
    problems: list[str] = []
    for static in statics:
        links, handle, found = read_gpu_links(session, static, gpu_buses, sys_root=sys_root)
        gpus.append(links)
        problems.extend(found)
        if links.error is not None:
            problems.append(f"GPU {static.index}: {links.error}")
        elif handle is not None:
            handles[static.index] = handle
    ancestors: dict[tuple[int, int], int] = {}
    indices = sorted(handles)
    for pos, a in enumerate(indices):
        for b in indices[pos + 1:]:
            try:
                # No gpu= here: a lost answer does not say which of the two is gone.
                level = session.call("nvmlDeviceGetTopologyCommonAncestor", handles[a],
                                     handles[b])
            except NvmlError as err:
                problems.append(f"GPUs {a}-{b}: {err.detail}")
                continue
            ancestors[(a, b)] = int(level)
    for problem in problems:
        log.warning("topology discovery", extra={"problem": problem})
    return NodeLinks(gpus=tuple(gpus), ancestors=ancestors, problems=tuple(problems))
