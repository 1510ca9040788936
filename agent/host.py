"""Facts about the host that do not come from NVML."""

from __future__ import annotations

from pathlib import Path


def boot_id(proc_root: Path) -> str:
    """The kernel's boot id (changes on every boot); the simulator writes its own under its
    proc root. Falls back to the real one, then to ``unknown``."""
    for root in (proc_root, Path("/proc")):
        try:
            return (root / "sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            continue
    return "unknown"
