"""Identifiers the simulated node derives rather than stores: GPU and MIG device UUIDs, and
compute-instance names (profile names come from :mod:`agent.gpu.naming`)."""

from __future__ import annotations

import uuid

# Fixed namespace so the same (preset, seed, index) always yields the same UUID.
_UUID_NAMESPACE = uuid.UUID("4f1d7c2e-9b0a-5e33-8c71-6a2f0d9e5b14")


def compute_instance_name(ci_slices: int, gi_name: str, *, whole: bool) -> str:
    """``3g.40gb`` for the CI that spans its GI, ``1c.3g.40gb`` for a smaller one."""
    return gi_name if whole else f"{ci_slices}c.{gi_name}"


def gpu_uuid(preset: str, seed: str, index: int) -> str:
    """``GPU-<uuid>``: stable for one simulated node, different between nodes (the seed)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'gpu/{preset}/{seed}/{index}')}"


def mig_uuid(parent_uuid: str, gi_id: int, ci_id: int, serial: int) -> str:
    """``MIG-<uuid>``: the serial makes a re-created instance a new device, as on hardware."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'mig/{parent_uuid}/{gi_id}/{ci_id}/{serial}')}"
