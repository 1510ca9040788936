"""MIG profile names derived the way go-nvlib derives them, so configs written for the real
tools (``1g.10gb``, ``3g.71gb``) resolve against what NVML reports."""

from __future__ import annotations

import math


def _round_half_away(value: float) -> int:
    # Go's math.Round; Python's round() is banker's rounding and names 70.5 GB as 70.
    return math.floor(value + 0.5)


def mig_memory_gb(memory_mib: int, total_mib: int) -> int:
    """GB in a MIG profile name: the profile's share of memory in eighths, times the GPU's GiB."""
    eighths = math.ceil(memory_mib / total_mib * 8)
    return _round_half_away(eighths / 8 * math.ceil(total_mib / 1024))


def mig_profile_name(slices: int, memory_mib: int, total_mib: int, *,
                     media_extensions: bool = False) -> str:
    """``<slices>g.<GB>gb`` with ``+me`` for the profile that carries the media engines."""
    name = f"{slices}g.{mig_memory_gb(memory_mib, total_mib)}gb"
    return name + "+me" if media_extensions else name
