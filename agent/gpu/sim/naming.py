"""Names and identifiers the simulated node derives rather than stores: MIG profile names (the
go-nvlib formula), GPU and MIG device UUIDs."""

from __future__ import annotations

import math
import uuid

_MIB = 1024 * 1024
_GIB = 1024 * 1024 * 1024
# Fixed namespace so the same (preset, seed, index) always yields the same UUID.
_UUID_NAMESPACE = uuid.UUID("4f1d7c2e-9b0a-5e33-8c71-6a2f0d9e5b14")


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
                     media_extensions: bool) -> str:
    """``<slices>g.<GB>gb``, plus ``+me`` for the profile that carries the media engines."""
    name = f"{slices}g.{mig_memory_gb(memory_mib, total_mib)}gb"
    return f"{name}+me" if media_extensions else name


def compute_instance_name(ci_slices: int, gi_name: str, *, whole: bool) -> str:
    """``3g.40gb`` for the CI that spans its GI, ``1c.3g.40gb`` for a smaller one."""
    return gi_name if whole else f"{ci_slices}c.{gi_name}"


def gpu_uuid(preset: str, seed: str, index: int) -> str:
    """``GPU-<uuid>``: stable for one simulated node, different between nodes (the seed)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'gpu/{preset}/{seed}/{index}')}"


def mig_uuid(parent_uuid: str, gi_id: int, ci_id: int, serial: int) -> str:
    """``MIG-<uuid>``: the serial makes a re-created instance a new device, as on hardware."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'mig/{parent_uuid}/{gi_id}/{ci_id}/{serial}')}"
