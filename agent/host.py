"""Facts about the host that do not come from NVML."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

# glibc's mallopt parameter for the number of malloc arenas.
_M_ARENA_MAX = -8


def boot_id(proc_root: Path) -> str:
    """The kernel's boot id (changes on every boot); the simulator writes its own under its
    proc root. Falls back to the real one, then to ``unknown``."""
    for root in (proc_root, Path("/proc")):
        try:
            return (root / "sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            continue
    return "unknown"


def limit_malloc_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas before any thread starts: the agent's dozen threads (NVML
    workers, the collector, the event watcher) would otherwise each get an arena whose
    partly-used pages stay resident (about 2 MiB of RSS here). Same as MALLOC_ARENA_MAX,
    which wins when set. False where the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, count))
