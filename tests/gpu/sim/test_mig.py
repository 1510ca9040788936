"""GPU and compute instances behave as NVML's: placements, overlap, auto-placement order,
capacity, IN_USE, stale handles, and MIG device enumeration."""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu.sim.node import SimulatedNode

from .conftest import NodeFactory, create_gi, enable_mig, gi_placements, nvml_code, placement

ERR_RESOURCES = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
ERR_INVALID = pynvml.NVML_ERROR_INVALID_ARGUMENT


def _gi_info(node: SimulatedNode, gi: Any) -> tuple[int, int, int, int]:
    info = node.nvml.nvmlGpuInstanceGetInfo(gi)
    return info.id, info.profileId, info.placement.start, info.placement.size


@pytest.mark.parametrize(("first", "second"), [
    ((9, (0, 4)), (14, (2, 2))),
    ((0, (0, 8)), (19, (6, 1))),
    ((15, (6, 2)), (19, (6, 1))),
    ((5, (0, 4)), (9, (0, 4))),
])
def test_overlapping_create_is_insufficient_resources(h100: SimulatedNode,
                                                      first: tuple[int, tuple[int, int]],
                                                      second: tuple[int, tuple[int, int]]) -> None:
    """A GI whose memory slices overlap an existing one fails with INSUFFICIENT_RESOURCES."""
    handle = enable_mig(h100)
    create_gi(h100, handle, first[0], first[1])
    with pytest.raises(pynvml.NVMLError) as excinfo:
        create_gi(h100, handle, second[0], second[1])
    assert nvml_code(excinfo) == ERR_RESOURCES


@pytest.mark.parametrize(("profile_id", "at"), [(9, (2, 4)), (9, (0, 3)), (14, (1, 2)),
                                                 (19, (7, 1)), (0, (0, 7)), (15, (1, 2))])
def test_placement_not_in_the_profile_list_is_invalid(h100: SimulatedNode, profile_id: int,
                                                     at: tuple[int, int]) -> None:
    """A placement that is not one of the profile's possible placements is INVALID_ARGUMENT
    (3g must be {0,4}:4 on H100, not the go-nvml mock's size 3)."""
    with pytest.raises(pynvml.NVMLError) as excinfo:
        create_gi(h100, enable_mig(h100), profile_id, at)
    assert nvml_code(excinfo) == ERR_INVALID


@pytest.mark.parametrize("profile_id", [1, 2, 7, 0x12, 21, 99])
def test_profile_ids_that_are_not_device_ids_are_invalid(h100: SimulatedNode,
                                                         profile_id: int) -> None:
    """Create, placements and capacity take device profile IDs only; index constants such as
    1 (2_SLICE) or 7 (+me) are INVALID_ARGUMENT."""
    handle = enable_mig(h100)
    calls: list[Callable[[], object]] = [
        lambda: h100.nvml.nvmlDeviceCreateGpuInstance(handle, profile_id),
        lambda: h100.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile_id),
        lambda: h100.nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, None, ctypes.byref(ctypes.c_uint())),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError) as excinfo:
            call()
        assert nvml_code(excinfo) == ERR_INVALID


def test_auto_placement_follows_the_driver_order_for_1g(h100: SimulatedNode) -> None:
    """Seven auto-placed 1g land in slots 6,4,5,0,1,2,3 with GI ids 13,11,12,7,8,9,10."""
    handle = enable_mig(h100)
    got = [_gi_info(h100, create_gi(h100, handle, 19)) for _ in range(7)]
    assert [(i, s) for i, _, s, _ in got] == [(13, 6), (11, 4), (12, 5), (7, 0), (8, 1),
                                              (9, 2), (10, 3)]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create_gi(h100, handle, 19)


def test_auto_placement_puts_2g_at_4_on_an_empty_a100(a100: SimulatedNode) -> None:
    """On an empty A100 a 2g goes to 4:2 (GI 5) and a 4g to 0:4."""
    handle = enable_mig(a100)
    assert _gi_info(a100, create_gi(a100, handle, 14)) == (5, 14, 4, 2)
    assert _gi_info(a100, create_gi(a100, handle, 5))[2:] == (0, 4)


@pytest.mark.parametrize("preset", ["dgx-a100", "dgx-h100"])
def test_guide_ordering_trap_fails_on_the_3g(make_node: NodeFactory, preset: str) -> None:
    """``-cgi 19,19,14,9`` with auto-placement fails on the 3g (INSUFFICIENT_RESOURCES)."""
    node = make_node(preset)
    handle = enable_mig(node)
    for profile_id in (19, 19, 14):
        create_gi(node, handle, profile_id)
    with pytest.raises(pynvml.NVMLError) as excinfo:
        create_gi(node, handle, 9)
    assert nvml_code(excinfo) == ERR_RESOURCES


@pytest.mark.parametrize("preset", ["dgx-a100", "dgx-h100"])
def test_same_set_succeeds_placed_explicitly_or_3g_first(make_node: NodeFactory,
                                                        preset: str) -> None:
    """The same 1g,1g,2g,3g set fits with explicit placements, and auto-placed 3g first."""
    node = make_node(preset)
    explicit = enable_mig(node, 0)
    for profile_id, at in ((19, (0, 1)), (19, (1, 1)), (14, (2, 2)), (9, (4, 4))):
        create_gi(node, explicit, profile_id, at)
    auto = enable_mig(node, 1)
    for profile_id in (9, 14, 19, 19):
        create_gi(node, auto, profile_id)
    for handle in (explicit, auto):
        assert node.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 19) == 0


def test_only_one_media_extension_instance(h100: SimulatedNode) -> None:
    """1g+me (profile 20) has one instance at most; a second fails though slots are free."""
    handle = enable_mig(h100)
    create_gi(h100, handle, 20, (0, 1))
    assert h100.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 20) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create_gi(h100, handle, 20, (1, 1))
    create_gi(h100, handle, 19, (1, 1))


def test_remaining_capacity_after_one_3g(h100: SimulatedNode) -> None:
    """After one 3g at 0:4, 1g capacity drops from 7 to 3, 2g from 3 to 1, 7g to 0."""
    handle = enable_mig(h100)
    capacity = h100.nvml.nvmlDeviceGetGpuInstanceRemainingCapacity
    assert [capacity(handle, p) for p in (19, 20, 15, 14, 9, 5, 0)] == [7, 1, 4, 3, 2, 1, 1]
    create_gi(h100, handle, 9, (0, 4))
    assert [capacity(handle, p) for p in (19, 20, 15, 14, 9, 5, 0)] == [3, 1, 2, 1, 1, 0, 0]


def test_gpu_instance_ids_follow_the_guide(h100: SimulatedNode) -> None:
    """GI ids are deterministic by profile and start: 7g 0, 3g 1/2, 4g 1, 2g 3/4/5,
    1g.20gb 3/4/5/6, 1g slot s -> 7+s."""
    handle = enable_mig(h100)
    cases = [(0, (0, 8), 0)]
    for profile_id, at, gi_id in cases:
        gi = create_gi(h100, handle, profile_id, at)
        assert _gi_info(h100, gi)[0] == gi_id
        h100.nvml.nvmlGpuInstanceDestroy(gi)
    layout = [(9, (0, 4), 1), (14, (4, 2), 5), (15, (6, 2), 6)]
    for profile_id, at, gi_id in layout:
        assert _gi_info(h100, create_gi(h100, handle, profile_id, at))[0] == gi_id
    handles = (pynvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(8)
    h100.nvml.nvmlDeviceGetGpuInstances(handle, 9, handles, ctypes.pointer(count))
    assert count.value == 1
    found = h100.nvml.nvmlDeviceGetGpuInstanceById(handle, 1)
    assert _gi_info(h100, found) == (1, 9, 0, 4)
    with pytest.raises(pynvml.NVMLError_NotFound):
        h100.nvml.nvmlDeviceGetGpuInstanceById(handle, 2)


def test_gi_destroy_with_a_ci_is_in_use(h100: SimulatedNode) -> None:
    """Destroying a GI that still has a CI fails with IN_USE; after the CI goes it succeeds."""
    gi = create_gi(h100, enable_mig(h100), 9)
    ci = h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    with pytest.raises(pynvml.NVMLError_InUse):
        h100.nvml.nvmlGpuInstanceDestroy(gi)
    h100.nvml.nvmlComputeInstanceDestroy(ci)
    h100.nvml.nvmlGpuInstanceDestroy(gi)


def test_ci_destroy_with_a_process_is_in_use(h100: SimulatedNode) -> None:
    """Destroying a CI with a process on its MIG device fails with IN_USE until it exits."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 14)
    ci = h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 1)
    mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    process = h100.add_process(h100.nvml.nvmlDeviceGetUUID(mig))
    with pytest.raises(pynvml.NVMLError_InUse):
        h100.nvml.nvmlComputeInstanceDestroy(ci)
    h100.remove_process(process["pid"])
    h100.nvml.nvmlComputeInstanceDestroy(ci)


def test_handles_of_destroyed_instances_are_stale(h100: SimulatedNode) -> None:
    """GI, CI and MIG device handles of destroyed instances answer INVALID_ARGUMENT, also
    after an instance is re-created in the same place."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 9, (4, 4))
    ci = h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    old_uuid = h100.nvml.nvmlDeviceGetUUID(mig)
    h100.nvml.nvmlComputeInstanceDestroy(ci)
    h100.nvml.nvmlGpuInstanceDestroy(gi)
    gi2 = create_gi(h100, handle, 9, (4, 4))
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi2, 2)
    stale_calls: list[Callable[[], object]] = [
        lambda: h100.nvml.nvmlGpuInstanceGetInfo(gi),
        lambda: h100.nvml.nvmlGpuInstanceDestroy(gi),
        lambda: h100.nvml.nvmlComputeInstanceGetInfo(ci),
        lambda: h100.nvml.nvmlComputeInstanceDestroy(ci),
        lambda: h100.nvml.nvmlDeviceGetUUID(mig),
        lambda: h100.nvml.nvmlDeviceGetAttributes(mig),
    ]
    for call in stale_calls:
        with pytest.raises(pynvml.NVMLError) as excinfo:
            call()
        assert nvml_code(excinfo) == ERR_INVALID
    new_mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert h100.nvml.nvmlDeviceGetUUID(new_mig) != old_uuid
    assert _gi_info(h100, gi2)[0] == 2


@pytest.fixture
def h100_on_tmpfs() -> Iterator[SimulatedNode]:
    """A DGX H100 whose hardware state lives on a tmpfs where there is one: the test below
    makes 12,000 mutations, each saved durably, and measures the handle table, not the
    disk (on ext4 its fsyncs alone took 12-80 s)."""
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as directory:
        node = SimulatedNode("dgx-h100", Path(directory) / "state", Path(directory) / "proc")
        node.nvml.nvmlInit()
        try:
            yield node
        finally:
            node.close()


def test_handles_of_destroyed_instances_are_forgotten_but_stay_stale(
        h100_on_tmpfs: SimulatedNode) -> None:
    """Thousands of create/destroy cycles keep a bounded handle table (a soak's RSS grew
    while every instance ever made stayed referenced); a handle forgotten so stays stale."""
    h100 = h100_on_tmpfs
    handle = enable_mig(h100)
    first = create_gi(h100, handle, 19, (0, 1))
    h100.nvml.nvmlGpuInstanceDestroy(first)
    for _ in range(3_000):
        gi = create_gi(h100, handle, 19, (0, 1))
        ci = h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        h100.nvml.nvmlComputeInstanceDestroy(ci)
        h100.nvml.nvmlGpuInstanceDestroy(gi)
    assert h100.nvml.handles_known < 5_000  # 6,000 instances were made
    with pytest.raises(pynvml.NVMLError) as excinfo:
        h100.nvml.nvmlGpuInstanceGetInfo(first)
    assert nvml_code(excinfo) == ERR_INVALID
    live = create_gi(h100, handle, 19, (0, 1))
    assert h100.nvml.nvmlGpuInstanceGetInfo(live).placement.start == 0


def test_gi_without_ci_is_invisible_to_mig_device_enumeration(h100: SimulatedNode) -> None:
    """A GI with no CI shows in GetGpuInstances but has no MIG device handle (dra #1452)."""
    handle = enable_mig(h100)
    create_gi(h100, handle, 9, (0, 4))
    assert gi_placements(h100, handle, 9) == [(0, 4)]
    assert h100.nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 7
    for index in range(7):
        with pytest.raises(pynvml.NVMLError_NotFound):
            h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 7)


def test_mig_devices_enumerate_by_gi_then_ci(h100: SimulatedNode) -> None:
    """One MIG device per CI, ordered by GI id then CI id, with attributes of their CI/GI."""
    handle = enable_mig(h100)
    gi_small = create_gi(h100, handle, 19, (2, 1))  # GI 9
    gi_big = create_gi(h100, handle, 9, (4, 4))     # GI 2
    gi_mid = create_gi(h100, handle, 14, (0, 2))    # GI 3
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi_small, 0)
    for _ in range(2):
        h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi_mid, 0)
    h100.nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        gi_big, 2, ctypes.byref(pynvml.c_nvmlComputeInstancePlacement_t(0, 3)))
    seen = []
    for index in range(h100.nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        assert h100.nvml.nvmlDeviceIsMigDeviceHandle(mig)
        parent = h100.nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert h100.nvml.nvmlDeviceGetUUID(parent) == h100.nvml.nvmlDeviceGetUUID(handle)
        attributes = h100.nvml.nvmlDeviceGetAttributes(mig)
        seen.append((h100.nvml.nvmlDeviceGetGpuInstanceId(mig),
                     h100.nvml.nvmlDeviceGetComputeInstanceId(mig),
                     attributes.multiprocessorCount, attributes.gpuInstanceSliceCount,
                     attributes.computeInstanceSliceCount, attributes.memorySizeMB))
        assert h100.nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert seen == [(2, 0, 60, 3, 3, 40448), (3, 0, 16, 2, 1, 20096), (3, 1, 16, 2, 1, 20096),
                    (9, 0, 16, 1, 1, 9984)]
    assert not h100.nvml.nvmlDeviceIsMigDeviceHandle(handle)
    names = [h100.nvml.nvmlDeviceGetName(h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
             for i in (0, 1)]
    assert names == ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA H100 80GB HBM3 MIG 1c.2g.20gb"]


def test_mig_uuid_resolves_to_a_mig_handle(h100: SimulatedNode) -> None:
    """GetHandleByUUID accepts MIG-... UUIDs (str or bytes); unknown UUIDs are NOT_FOUND."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 0)
    h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, 4)
    mig_uuid = h100.nvml.nvmlDeviceGetUUID(h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0))
    for key in (mig_uuid, mig_uuid.encode()):
        mig = h100.nvml.nvmlDeviceGetHandleByUUID(key)
        assert h100.nvml.nvmlDeviceGetComputeInstanceId(mig) == 0
        memory = h100.nvml.nvmlDeviceGetMemoryInfo(mig)
        assert memory.total == 81152 * 1024 * 1024
    with pytest.raises(pynvml.NVMLError_NotFound):
        h100.nvml.nvmlDeviceGetHandleByUUID("MIG-00000000-0000-0000-0000-000000000000")


def test_ci_overlap_capacity_and_ids(h100: SimulatedNode) -> None:
    """CIs overlap by compute slice (INSUFFICIENT_RESOURCES), take the lowest free id, and
    report remaining capacity the way GIs do."""
    gi = create_gi(h100, enable_mig(h100), 0)
    nvml = h100.nvml
    assert nvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 2) == 2
    first = nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        gi, 2, pynvml.c_nvmlComputeInstancePlacement_t(0, 3))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
            gi, 1, pynvml.c_nvmlComputeInstancePlacement_t(2, 2))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
            gi, 1, pynvml.c_nvmlComputeInstancePlacement_t(1, 2))
    assert nvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 4
    assert nvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 4) == 0
    second = nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert nvml.nvmlComputeInstanceGetInfo(second).id == 1
    assert nvml.nvmlComputeInstanceGetInfo(second).placement.start == 3
    nvml.nvmlComputeInstanceDestroy(first)
    third = nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    info = nvml.nvmlComputeInstanceGetInfo(third)
    assert (info.id, info.placement.start, info.placement.size) == (0, 0, 1)
    assert _gi_info(h100, info.gpuInstance)[0] == 0
    assert nvml.nvmlDeviceGetUUID(info.device) == nvml.nvmlDeviceGetUUID(
        nvml.nvmlDeviceGetHandleByIndex(0))
    by_id = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, 1)
    assert nvml.nvmlComputeInstanceGetInfo(by_id).profileId == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlGpuInstanceGetComputeInstanceById(gi, 5)


def test_array_arguments_follow_the_c_conventions(h100: SimulatedNode) -> None:
    """A NULL array asks for the count; the count passed in is the capacity (byref, pointer or
    the c_uint itself); too small -> INSUFFICIENT_SIZE with the needed count written."""
    handle = enable_mig(h100)
    nvml = h100.nvml
    query = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, None, query)
    assert query.value == 7
    small = ctypes.c_uint(3)
    array = (pynvml.c_nvmlGpuInstancePlacement_t * 3)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, array, ctypes.byref(small))
    assert small.value == 7
    for _ in range(3):
        create_gi(h100, handle, 19)
    gis = (pynvml.c_nvmlGpuInstance_t * 7)()
    count = ctypes.c_uint(7)
    assert nvml.nvmlDeviceGetGpuInstances(handle, 19, gis, ctypes.pointer(count)) == 0
    assert count.value == 3
    assert sorted(_gi_info(h100, g)[2] for g in gis[:3]) == [4, 5, 6]
    count = ctypes.c_uint(2)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstances(handle, 19, gis, ctypes.byref(count))
    gi = gis[0]
    cis = (pynvml.c_nvmlComputeInstance_t * 1)()
    ci_count = ctypes.c_uint(1)
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    nvml.nvmlGpuInstanceGetComputeInstances(gi, 0, cis, ctypes.byref(ci_count))
    assert ci_count.value == 1
    assert nvml.nvmlComputeInstanceGetInfo(cis[0]).id == 0


def test_placement_argument_forms(h100: SimulatedNode) -> None:
    """CreateWithPlacement takes the struct, byref(struct) or pointer(struct); anything else
    (None, a tuple, a NULL pointer) is INVALID_ARGUMENT."""
    handle = enable_mig(h100)
    nvml = h100.nvml
    for start, form in ((0, lambda p: p), (2, ctypes.byref), (4, ctypes.pointer)):
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 14, form(placement(start, 2)))
        assert _gi_info(h100, gi)[2] == start
    for bad in (None, (6, 1), ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t)()):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, bad)


def test_wrong_handle_kinds_are_invalid(h100: SimulatedNode) -> None:
    """A GI handle where a CI or device handle belongs (and garbage) is INVALID_ARGUMENT."""
    handle = enable_mig(h100)
    gi = create_gi(h100, handle, 0)
    for call in (lambda: h100.nvml.nvmlComputeInstanceDestroy(gi),
                 lambda: h100.nvml.nvmlDeviceGetUUID(gi),
                 lambda: h100.nvml.nvmlGpuInstanceGetInfo(handle),
                 lambda: h100.nvml.nvmlGpuInstanceGetInfo(pynvml.c_nvmlGpuInstance_t()),
                 lambda: h100.nvml.nvmlDeviceGetUUID(42)):
        with pytest.raises(pynvml.NVMLError) as excinfo:
            call()
        assert nvml_code(excinfo) == ERR_INVALID
