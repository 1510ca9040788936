"""MIG profile names derived the way go-nvlib derives them, so configs written for the real
tools (``1g.10gb``, ``3g.71gb``) resolve against what NVML reports."""

from __future__ import annotations

import math

_MIB = 1024 * 1024
_GIB = 1024 * 1024 * 1024


def _go_round(value: float) -> int:
    """Go's ``math.Round`` (half away from zero); Python's ``round`` would name 70.5 GB as 70."""
    whole = math.trunc(value)
    if abs(value - whole) >= 0.5:
        whole += int(math.copysign(1, value))
    return int(whole)


def mig_memory_gb(memory_mib: int, total_mib: int) -> int:
    """The GB figure of a MIG profile name, computed exactly as go-nvlib's
    ``getMigMemorySizeGB`` does (float64 arithmetic on bytes)."""
    total_bytes = total_mib * _MIB
    fraction = (float(memory_mib) * _MIB) / float(total_bytes)
    fraction = math.ceil(fraction * 8) / 8
    total_gb = float((total_bytes + _GIB - 1) // _GIB)
    return _go_round(fraction * total_gb)


def mig_profile_name(slices: int, memory_mib: int, total_mib: int, *,
                     media_extensions: bool = False) -> str:
    """``<slices>g.<GB>gb``, plus ``+me`` for the profile that carries the media engines."""
    name = f"{slices}g.{mig_memory_gb(memory_mib, total_mib)}gb"
    return f"{name}+me" if media_extensions else name
