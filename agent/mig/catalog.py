"""The planner's view of a GPU: its profile catalog and current geometry, built from what the
hardware layer read (values in, values out)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from agent.gpu.types import GiProfile, GpuInstanceState
from agent.mig.geometry import Catalog, Geometry, Instance, ProfileSpec


def catalog_of(profiles: Sequence[GiProfile]) -> Catalog:
    """The catalog of a GPU from the GPU-instance profiles NVML listed."""
    return Catalog(tuple(
        ProfileSpec(name=p.name, id=p.id, slices=p.slices, memory_mib=p.memory_mib,
                    multiprocessors=p.multiprocessors, max_instances=p.max_instances,
                    placements=p.placements, media_extensions=p.media_extensions)
        for p in profiles))


def geometry_of(catalog: Catalog, *, mig_enabled: bool, instances: Sequence[GpuInstanceState],
                held_gi_ids: Collection[int] = ()) -> Geometry:
    """The current geometry; GIs in ``held_gi_ids`` (claims, running processes) are held."""
    found = []
    for gi in instances:
        spec = catalog.by_id(gi.profile_id)
        name = spec.name if spec else f"profile-{gi.profile_id}"
        found.append(Instance(profile=name, placement=gi.placement, gi_id=gi.id,
                              held=gi.id in held_gi_ids))
    return Geometry(mig_enabled=mig_enabled, instances=tuple(found))
