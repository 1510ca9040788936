"""Files the NVIDIA kernel driver provides under /proc, written under the simulator's proc
root: the MIG capability minors (for CDI device nodes), the character-device majors, and the
boot id (the agent ties its checkpoint to it)."""

from __future__ import annotations

from pathlib import Path

from agent.durable import write_if_changed

MIG_MINORS = "driver/nvidia-caps/mig-minors"
DEVICES = "devices"
BOOT_ID = "sys/kernel/random/boot_id"

# Majors as a DGX shows them: 195 is fixed for nvidia; the others are dynamic and the kernel
# hands those out from 511 downwards once the low range is used.
NVIDIA_MAJOR = 195
NVIDIA_CAPS_MAJOR = 511
NVIDIA_UVM_MAJOR = 510
_NVIDIA_NVLINK_MAJOR = 509
_NVIDIA_NVSWITCH_MAJOR = 508
#: ``nvidia-caps-imex-channels``: the IMEX channel nodes' major (dynamic on a real node:
#: read it from /proc/devices, as NVIDIA's IMEX guide says).
NVIDIA_CAPS_IMEX_MAJOR = 507
_GIS_PER_GPU = 15
_CIS_PER_GI = 8


def gi_access_minor(gpu: int, gi: int) -> int:
    """Minor of ``/dev/nvidia-caps/nvidia-cap<N>`` granting access to a GPU instance."""
    return 3 + gpu * (_GIS_PER_GPU * (_CIS_PER_GI + 1)) + gi * (_CIS_PER_GI + 1)


def ci_access_minor(gpu: int, gi: int, ci: int) -> int:
    """Minor of the capability node granting access to a compute instance."""
    return gi_access_minor(gpu, gi) + 1 + ci


def mig_minors_text(gpu_count: int) -> str:
    """``/proc/driver/nvidia-caps/mig-minors`` in the driver's format and order."""
    lines = ["config 1", "monitor 2"]
    for gpu in range(gpu_count):
        for gi in range(_GIS_PER_GPU):
            lines.append(f"gpu{gpu}/gi{gi}/access {gi_access_minor(gpu, gi)}")
            lines.extend(f"gpu{gpu}/gi{gi}/ci{ci}/access {ci_access_minor(gpu, gi, ci)}"
                         for ci in range(_CIS_PER_GI))
    return "\n".join(lines) + "\n"


def devices_text(*, nvswitch: bool) -> str:
    """``/proc/devices`` of a GPU server (sorted by major, as the kernel prints it)."""
    char = [(1, "mem"), (4, "/dev/vc/0"), (4, "tty"), (4, "ttyS"), (5, "/dev/tty"),
            (5, "/dev/console"), (5, "/dev/ptmx"), (7, "vcs"), (10, "misc"), (13, "input"),
            (21, "sg"), (29, "fb"), (128, "ptm"), (136, "pts"), (180, "usb"),
            (189, "usb_device"), (NVIDIA_MAJOR, "nvidia-frontend"), (226, "drm"),
            (240, "ipmidev"), (241, "aux"), (242, "hidraw"), (243, "bsg"), (244, "watchdog"),
            (245, "ptp"), (246, "pps"), (247, "rtc"), (248, "dax"), (249, "dimmctl"),
            (250, "ndctl"), (251, "tpm"), (252, "nvme-generic"), (253, "nvme"),
            (254, "gpiochip"), (NVIDIA_CAPS_IMEX_MAJOR, "nvidia-caps-imex-channels"),
            (_NVIDIA_NVLINK_MAJOR, "nvidia-nvlink"), (NVIDIA_UVM_MAJOR, "nvidia-uvm"),
            (NVIDIA_CAPS_MAJOR, "nvidia-caps")]
    if nvswitch:
        char.append((_NVIDIA_NVSWITCH_MAJOR, "nvidia-nvswitch"))
    block = [(7, "loop"), (8, "sd"), (9, "md"), (65, "sd"), (128, "sd"), (253, "device-mapper"),
             (254, "mdp"), (259, "blkext")]
    lines = ["Character devices:"]
    lines.extend(f"{major:3d} {name}" for major, name in sorted(char, key=lambda c: c[0]))
    lines.extend(["", "Block devices:"])
    lines.extend(f"{major:3d} {name}" for major, name in block)
    return "\n".join(lines) + "\n"


def write_static(proc_root: Path, *, gpu_count: int, nvswitch: bool) -> None:
    """Write the files that only change with the hardware (MIG minors, device majors)."""
    write_if_changed(proc_root / MIG_MINORS, mig_minors_text(gpu_count).encode())
    write_if_changed(proc_root / DEVICES, devices_text(nvswitch=nvswitch).encode())


def write_boot_id(proc_root: Path, boot_id: str) -> None:
    write_if_changed(proc_root / BOOT_ID, f"{boot_id}\n".encode())
