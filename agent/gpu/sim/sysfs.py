"""The PCI part of ``/sys`` the simulated node provides: ``bus/pci/devices/<BDF>`` links into
``devices/pci<domain>:<root bus>/...``, which is where the PCIe root of a GPU is read from."""

from __future__ import annotations

import os
from pathlib import Path

from agent.gpu.sim.presets import Preset


def root_bus(preset: Preset, index: int) -> int:
    """Bus of the root port above GPU ``index``: GPUs on one PCIe switch share it."""
    switches = preset.pcie_switches
    members = ([i for i, s in enumerate(switches) if s == switches[index]] if switches
               else [index])
    return min(preset.bus_numbers[i] for i in members) - 4


def write_pci_devices(sys_root: Path, preset: Preset) -> None:
    """Create (or refresh) the device directories and the ``bus/pci/devices`` links."""
    devices = sys_root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    for index, bus in enumerate(preset.bus_numbers):
        root = root_bus(preset, index)
        bdf = f"0000:{bus:02x}:00.0"
        port = f"0000:{root:02x}:01.0"
        target = sys_root / "devices" / f"pci0000:{root:02x}" / port / bdf
        target.mkdir(parents=True, exist_ok=True)
        link = devices / bdf
        relative = os.path.relpath(target, devices)
        if link.is_symlink() and os.readlink(link) == relative:
            continue
        tmp = devices / f".{bdf}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(relative)
        os.replace(tmp, link)
