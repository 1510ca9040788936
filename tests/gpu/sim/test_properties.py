"""Properties over random create/destroy sequences: GPU instances never overlap, and the
remaining capacity NVML reports is exactly how many more instances can be created."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gpu.sim.hardware import SimulatedHardware
from agent.gpu.sim.nvml import SimulatedNvml
from agent.gpu.sim.presets import PRESETS
from agent.gpu.sim.state import HardwareState

# (profile id, start) for every possible placement of every profile.
PLACEMENTS = [(p.id, start) for p in PRESETS["dgx-h100"].gpu.gi_profiles for start in p.starts]
Step = tuple[str, int]
steps = st.lists(st.one_of(
    st.tuples(st.just("create"), st.integers(0, len(PLACEMENTS) - 1)),
    st.tuples(st.just("destroy"), st.integers(0, 7)),
), max_size=25)


def _fresh(preset: str) -> tuple[SimulatedNvml, Any]:
    """An in-memory simulated node (no state file) with MIG on GPU 0."""
    nvml = SimulatedNvml(SimulatedHardware(PRESETS[preset], HardwareState.new(PRESETS[preset])))
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    return nvml, handle


def _instances(nvml: SimulatedNvml, handle: Any, profile_ids: list[int]) -> list[Any]:
    found = []
    for profile_id in profile_ids:
        array = (pynvml.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint(8)
        nvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
        found.extend(array[: count.value])
    return found


def _apply(nvml: SimulatedNvml, handle: Any, sequence: list[Step], profile_ids: list[int]) -> None:
    """Run the steps, checking each create against a shadow model of occupied slices."""
    profiles = {p.id: p for p in PRESETS["dgx-h100"].gpu.gi_profiles}
    shadow: list[tuple[int, int, int]] = []  # (profile id, start, size)
    for action, arg in sequence:
        if action == "create":
            profile_id, start = PLACEMENTS[arg]
            size = profiles[profile_id].size
            fits = (sum(1 for p, _, _ in shadow if p == profile_id)
                    < profiles[profile_id].instance_count
                    and all(start + size <= s or s + n <= start for _, s, n in shadow))
            try:
                nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, profile_id, pynvml.c_nvmlGpuInstancePlacement_t(start, size))
            except pynvml.NVMLError_InsufficientResources:
                assert not fits, (profile_id, start, shadow)
            else:
                assert fits, (profile_id, start, shadow)
                shadow.append((profile_id, start, size))
        else:
            existing = _instances(nvml, handle, profile_ids)
            if existing:
                gi = existing[arg % len(existing)]
                info = nvml.nvmlGpuInstanceGetInfo(gi)
                nvml.nvmlGpuInstanceDestroy(gi)
                shadow.remove((info.profileId, info.placement.start, info.placement.size))


@settings(max_examples=200, deadline=None)
@given(sequence=steps)
def test_random_sequences_never_overlap_and_capacity_is_exact(sequence: list[Step]) -> None:
    """After any sequence of placed creates (failures allowed) and destroys, no two GIs share
    a memory slice, ids are unique, and for every profile RemainingCapacity equals the number
    of auto-placed creates that then succeed."""
    nvml, handle = _fresh("dgx-h100")
    profile_ids = sorted({p for p, _ in PLACEMENTS})
    _apply(nvml, handle, sequence, profile_ids)
    infos = [nvml.nvmlGpuInstanceGetInfo(gi) for gi in _instances(nvml, handle, profile_ids)]
    slices = [s for i in infos for s in range(i.placement.start,
                                              i.placement.start + i.placement.size)]
    assert len(slices) == len(set(slices))
    assert len({i.id for i in infos}) == len(infos)
    for profile_id in profile_ids:
        capacity = nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile_id)
        created = []
        for _ in range(capacity):
            created.append(nvml.nvmlDeviceCreateGpuInstance(handle, profile_id))
        try:
            extra = nvml.nvmlDeviceCreateGpuInstance(handle, profile_id)
        except pynvml.NVMLError_InsufficientResources:
            pass
        else:
            raise AssertionError(f"profile {profile_id}: created more than capacity {capacity}",
                                 extra)
        for gi in created:
            nvml.nvmlGpuInstanceDestroy(gi)
