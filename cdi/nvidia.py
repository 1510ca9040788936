"""NVIDIA's container edits, from values: device nodes with type/major/minor (so a runtime can
create them without a host node at the same path), the two ``nvidia-cap`` nodes of a MIG
device (minors from ``mig-minors``, major from ``/proc/devices``), and
``NVIDIA_VISIBLE_DEVICES=void`` so the legacy runtime hook does not act a second time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cdi.spec import ContainerEdits, DeviceNode, Hook, Mount

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"


class HostFactsError(ValueError):
    """/proc does not say what a device node needs (driver not loaded, MIG minors missing)."""


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character-device majors by driver name from ``/proc/devices``."""
    majors: dict[str, int] = {}
    in_char = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(":"):
            in_char = line == "Character devices:"
            continue
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi2/access`` → 21, from ``/proc/driver/nvidia-caps/mig-minors``."""
    minors: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


@dataclass(frozen=True)
class HostDevices:
    """What the host says about NVIDIA device nodes."""

    majors: Mapping[str, int]
    mig_minors: Mapping[str, int]

    def major(self, driver: str) -> int:
        try:
            return self.majors[driver]
        except KeyError:
            raise HostFactsError(f"/proc/devices lists no {driver!r} character device; is the "
                                 "NVIDIA driver loaded?") from None

    def cap_minor(self, key: str) -> int:
        try:
            return self.mig_minors[key]
        except KeyError:
            raise HostFactsError(f"mig-minors has no {key!r}") from None


def _char(path: str, major: int, minor: int) -> DeviceNode:
    return DeviceNode(path=path, type="c", major=major, minor=minor)


def gpu_edits(minor: int) -> ContainerEdits:
    """A full GPU: ``/dev/nvidia<minor>``."""
    return ContainerEdits(device_nodes=(_char(f"/dev/nvidia{minor}", NVIDIA_MAJOR, minor),))


def mig_edits(host: HostDevices, parent_minor: int, gi_id: int, ci_id: int) -> ContainerEdits:
    """A MIG device: its parent's node plus the GI and CI access capability nodes; without
    those the container sees only the unusable parent (dra-driver #787)."""
    caps = host.major("nvidia-caps")
    gi = host.cap_minor(f"gpu{parent_minor}/gi{gi_id}/access")
    ci = host.cap_minor(f"gpu{parent_minor}/gi{gi_id}/ci{ci_id}/access")
    return ContainerEdits(device_nodes=(
        _char(f"/dev/nvidia{parent_minor}", NVIDIA_MAJOR, parent_minor),
        _char(f"/dev/nvidia-caps/nvidia-cap{gi}", caps, gi),
        _char(f"/dev/nvidia-caps/nvidia-cap{ci}", caps, ci)))


#: The driver name of IMEX channels in ``/proc/devices``, and their directory under ``/dev``.
IMEX_CHANNELS = "nvidia-caps-imex-channels"


def imex_channel_path(channel: int) -> str:
    return f"/dev/{IMEX_CHANNELS}/channel{channel}"


def imex_channel_edits(host: HostDevices, channel: int) -> ContainerEdits:
    """An IMEX channel: its character device (the major is dynamic: read from
    ``/proc/devices``; the minor is the channel's number)."""
    return ContainerEdits(device_nodes=(
        _char(imex_channel_path(channel), host.major(IMEX_CHANNELS), channel),))


def merge(edits: Sequence[ContainerEdits]) -> ContainerEdits:
    """The union of device nodes (by path, first wins), for the ``all`` device."""
    seen: dict[str, DeviceNode] = {}
    for e in edits:
        for node in e.device_nodes or ():
            seen.setdefault(node.path, node)
    return ContainerEdits(device_nodes=tuple(seen.values()))


@dataclass(frozen=True)
class DriverFiles:
    """Driver libraries and binaries on the host, to bind-mount read-only (only when a driver
    root is configured; otherwise the runtime's own NVIDIA integration provides them)."""

    libraries: tuple[Path, ...]
    binaries: tuple[Path, ...]
    hook: str = "/usr/bin/nvidia-cdi-hook"


def common_edits(host: HostDevices, driver: DriverFiles | None = None) -> ContainerEdits:
    """Edits every NVIDIA container needs once: control and UVM nodes, the void env, and the
    driver's files when a driver root is configured."""
    uvm = host.major("nvidia-uvm")
    nodes = (_char("/dev/nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
             _char("/dev/nvidia-uvm", uvm, 0), _char("/dev/nvidia-uvm-tools", uvm, 1))
    if driver is None:
        return ContainerEdits(env=(VISIBLE_DEVICES_VOID,), device_nodes=nodes)
    options = ("ro", "nosuid", "nodev", "bind")
    mounts = tuple(Mount(host_path=str(p), container_path=str(p), options=options)
                   for p in (*driver.libraries, *driver.binaries))
    folders = sorted({str(p.parent) for p in driver.libraries})
    hooks = (Hook(hook_name="createContainer", path=driver.hook,
                  args=("nvidia-cdi-hook", "update-ldcache",
                        *(arg for f in folders for arg in ("--folder", f)))),) if folders else ()
    return ContainerEdits(env=(VISIBLE_DEVICES_VOID,), device_nodes=nodes, mounts=mounts,
                          hooks=hooks or None)
