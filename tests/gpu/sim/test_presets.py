"""The presets report the real hardware tables (reference/mig.md §1.2, §1.5, §1.6) through the
NVML calls the hardware layer makes."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.errors import InvalidRequest
from agent.gpu.inventory import read_gi_profiles, read_static
from agent.gpu.naming import mig_memory_gb, mig_profile_name
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.presets import PRESETS, get_preset, preset_names

from .conftest import NodeFactory, create_gi, enable_mig, nvml_code

# index constant, device id, name, MiB, SM, (CE, DEC, ENC, JPEG, OFA), instances, placements
A100_40GB = [
    (0x0, 19, "1g.5gb", 4864, 14, (1, 0, 0, 0, 0), 7, [(s, 1) for s in range(7)]),
    (0x7, 20, "1g.5gb+me", 4864, 14, (1, 1, 0, 1, 1), 1, [(s, 1) for s in range(7)]),
    (0x9, 15, "1g.10gb", 9856, 14, (1, 1, 0, 0, 0), 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (0x1, 14, "2g.10gb", 9856, 28, (2, 1, 0, 0, 0), 3, [(0, 2), (2, 2), (4, 2)]),
    (0x2, 9, "3g.20gb", 19968, 42, (3, 2, 0, 0, 0), 2, [(0, 4), (4, 4)]),
    (0x3, 5, "4g.20gb", 19968, 56, (4, 2, 0, 0, 0), 1, [(0, 4)]),
    (0x4, 0, "7g.40gb", 40192, 98, (7, 5, 0, 1, 1), 1, [(0, 8)]),
]
H100_80GB = [
    (0x0, 19, "1g.10gb", 9984, 16, (1, 1, 0, 1, 0), 7, [(s, 1) for s in range(7)]),
    (0x7, 20, "1g.10gb+me", 9984, 16, (1, 1, 0, 1, 1), 1, [(s, 1) for s in range(7)]),
    (0x9, 15, "1g.20gb", 20096, 26, (1, 1, 0, 1, 0), 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (0x1, 14, "2g.20gb", 20096, 32, (2, 2, 0, 2, 0), 3, [(0, 2), (2, 2), (4, 2)]),
    (0x2, 9, "3g.40gb", 40448, 60, (3, 3, 0, 3, 0), 2, [(0, 4), (4, 4)]),
    (0x3, 5, "4g.40gb", 40448, 64, (4, 4, 0, 4, 0), 1, [(0, 4)]),
    (0x4, 0, "7g.80gb", 81152, 132, (8, 7, 0, 7, 1), 1, [(0, 8)]),
]
# GB200: the names NVIDIA's tools use; MiB, the SMs past 2g and the engines past 2g are the
# preset's assumptions (verify on hardware), pinned here so a change is deliberate.
GB200 = [
    (0x0, 19, "1g.23gb", 23552, 18, (2, 1, 0, 1, 0), 7, [(s, 1) for s in range(7)]),
    (0x7, 20, "1g.23gb+me", 23552, 18, (2, 1, 0, 1, 1), 1, [(s, 1) for s in range(7)]),
    (0x9, 15, "1g.47gb", 47104, 32, (2, 1, 0, 1, 0), 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (0x1, 14, "2g.47gb", 47104, 38, (4, 2, 0, 2, 0), 3, [(0, 2), (2, 2), (4, 2)]),
    (0x2, 9, "3g.93gb", 94464, 72, (6, 3, 0, 3, 0), 2, [(0, 4), (4, 4)]),
    (0x3, 5, "4g.93gb", 94464, 76, (8, 4, 0, 4, 0), 1, [(0, 4)]),
    (0x4, 0, "7g.186gb", 188928, 152, (16, 7, 0, 7, 1), 1, [(0, 8)]),
]
TABLES = {"dgx-a100": A100_40GB, "dgx-h100": H100_80GB, "gb200-nvl72": GB200}
ROWS = [(preset, row) for preset, rows in TABLES.items() for row in rows]


def _placements(node: SimulatedNode, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    node.nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None,
                                                         ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    node.nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array,
                                                         ctypes.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


@pytest.mark.parametrize(("preset", "row"), ROWS, ids=[f"{p}-{r[2]}" for p, r in ROWS])
def test_gpu_instance_profile_matches_the_real_table(make_node: NodeFactory, preset: str,
                                                     row: tuple[Any, ...]) -> None:
    """ProfileInfo by index constant reports the real device id, name, memory, SMs, engines,
    instance count; PossiblePlacements the real placement list."""
    index, profile_id, name, mib, sms, engines, instances, placements = row
    node = make_node(preset)
    handle = enable_mig(node)
    info = node.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.name, info.memorySizeMB, info.multiprocessorCount) == (
        profile_id, f"MIG {name}", mib, sms)  # _PrintableStructure decodes char arrays
    assert (info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount,
            info.ofaCount) == engines
    assert info.instanceCount == instances
    assert info.sliceCount == int(name.split("g")[0])
    assert _placements(node, handle, profile_id) == placements
    by_id = node.nvml.nvmlDeviceGetGpuInstanceProfileInfoById(handle, profile_id)
    assert (by_id.id, by_id.name) == (profile_id, info.name)
    v1 = node.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index, version=1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t)
    assert (v1.id, v1.memorySizeMB) == (profile_id, mib)


REAL_H200 = Path(__file__).parents[2] / "data" / "hardware" / "h200-driver-580.159.04.json"


def test_hgx_h200_reads_like_a_real_h200(make_node: NodeFactory) -> None:
    """What a real H200 answered to the agent's own inventory code (a read-only device check,
    kept as a fixture): name, memory, every GPU-instance profile and its placements, with MIG
    mode off, as there."""
    real = json.loads(REAL_H200.read_text())
    node = make_node("hgx-h200")
    session = NvmlSession(node.nvml)
    try:
        static = read_static(session, 0)
        handle = session.gpu_handle(static.uuid)
        assert int(node.nvml.nvmlDeviceGetMemoryInfo(handle).total) == real["memory_total_bytes"]
        assert {key: getattr(static, key) for key in real["gpu"]} == real["gpu"]
        profiles = [{"name": p.name, "id": p.id, "slices": p.slices, "memory_mib": p.memory_mib,
                     "multiprocessors": p.multiprocessors, "copy_engines": p.copy_engines,
                     "decoders": p.decoders, "encoders": p.encoders,
                     "jpeg_engines": p.jpeg_engines, "ofa_engines": p.ofa_engines,
                     "max_instances": p.max_instances,
                     "placements": [{"start": x.start, "size": x.size} for x in p.placements]}
                    for p in read_gi_profiles(session, handle, static)]
    finally:
        session.close()
    assert profiles == real["gi_profiles"]


def test_index_constants_the_sku_lacks_are_not_supported(h100: SimulatedNode) -> None:
    """Index constants with no profile on H100 answer NOT_SUPPORTED; beyond COUNT, INVALID."""
    handle = enable_mig(h100)
    for index in (0x5, 0x6, 0x8, 0xA, 0xB, 0xC, 0xD, 0xE, 0xF, 0x10, 0x11):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            h100.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle,
                                                      pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)


@pytest.mark.parametrize(("preset", "names"), [
    ("dgx-h100", ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                  "7g.80gb"]),
    ("dgx-a100", ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb",
                  "7g.40gb"]),
    ("hgx-h200", ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb",
                  "7g.141gb"]),
    ("a100-pcie-bridged", ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb",
                           "4g.40gb", "7g.80gb"]),
    ("gb200-nvl72", ["1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb",
                     "7g.186gb"]),
])
def test_profile_names_derive_from_memory_like_go_nvlib(preset: str, names: list[str]) -> None:
    """Names come from per-profile MiB and the GPU total through go-nvlib's formula."""
    model = PRESETS[preset].gpu
    assert [p.name(model.memory_mib) for p in model.gi_profiles] == names


def test_naming_rounds_half_away_from_zero() -> None:
    """70.5 GB names as 71 (Go's math.Round), which Python's round() would make 70."""
    assert mig_memory_gb(71168, 143771) == 71
    assert mig_profile_name(3, 71168, 143771, media_extensions=False) == "3g.71gb"
    assert mig_profile_name(1, 4864, 40960, media_extensions=True) == "1g.5gb+me"


@pytest.mark.parametrize(("preset", "expected"), [
    ("dgx-a100", (8, "NVIDIA A100-SXM4-40GB", 40960, 0x20B010DE,
                  pynvml.NVML_DEVICE_ARCH_AMPERE, (8, 0))),
    ("dgx-h100", (8, "NVIDIA H100 80GB HBM3", 81559, 0x233010DE,
                  pynvml.NVML_DEVICE_ARCH_HOPPER, (9, 0))),
    ("hgx-h200", (8, "NVIDIA H200", 143771, 0x233510DE, pynvml.NVML_DEVICE_ARCH_HOPPER, (9, 0))),
    ("a100-pcie-bridged", (8, "NVIDIA A100 80GB PCIe", 81920, 0x20B510DE,
                           pynvml.NVML_DEVICE_ARCH_AMPERE, (8, 0))),
    ("l40s", (4, "NVIDIA L40S", 46068, 0x26B910DE, pynvml.NVML_DEVICE_ARCH_ADA, (8, 9))),
    ("gb200-nvl72", (4, "NVIDIA GB200", 189471, 0x294110DE, pynvml.NVML_DEVICE_ARCH_BLACKWELL,
                     (10, 0))),
])
def test_preset_gpus(make_node: NodeFactory, preset: str, expected: tuple[Any, ...]) -> None:
    """Each preset has its GPU count, model name, memory, PCI device id, architecture and CC."""
    count, name, mib, pci_id, arch, cc = expected
    nvml = make_node(preset).nvml
    assert nvml.nvmlDeviceGetCount() == count
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        assert nvml.nvmlDeviceGetName(handle) == name
        assert nvml.nvmlDeviceGetMemoryInfo(handle).total == mib * 1024 * 1024
        assert nvml.nvmlDeviceGetPciInfo(handle).pciDeviceId == pci_id
        assert nvml.nvmlDeviceGetArchitecture(handle) == arch
        assert nvml.nvmlDeviceGetCudaComputeCapability(handle) == cc
        assert nvml.nvmlDeviceGetBrand(handle) == pynvml.NVML_BRAND_NVIDIA
        assert nvml.nvmlDeviceGetIndex(handle) == nvml.nvmlDeviceGetMinorNumber(handle) == index


def test_dgx_h100_pci_numa_and_cpu_affinity(h100: SimulatedNode) -> None:
    """Bus ids 1B..DF; GPUs 0-3 on NUMA 0 (CPUs 0-55,112-167), 4-7 on NUMA 1."""
    nvml = h100.nvml
    buses = [0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF]
    for index, bus in enumerate(buses):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        assert pci.busId == f"00000000:{bus:02X}:00.0"
        assert pci.busIdLegacy == f"0000:{bus:02X}:00.0"
        assert (pci.domain, pci.bus, pci.device) == (0, bus, 0)
        numa = nvml.nvmlDeviceGetNumaNodeId(handle)
        assert numa == (0 if index < 4 else 1)
        words = nvml.nvmlDeviceGetCpuAffinity(handle, 4)
        cpus = {w * 64 + b for w in range(4) for b in range(64) if words[w] >> b & 1}
        first = 0 if numa == 0 else 56
        assert cpus == set(range(first, first + 56)) | set(range(first + 112, first + 168))


def test_dgx_a100_numa_cpus() -> None:
    """DGX A100: 2x64 cores with SMT, NUMA 0 = CPUs 0-63 and 128-191."""
    layout = PRESETS["dgx-a100"].cpus
    assert layout.cpu_count == 256
    assert layout.numa_cpus(0) == (*range(64), *range(128, 192))
    assert layout.numa_cpus(1) == (*range(64, 128), *range(192, 256))


def test_gb200_tray_has_two_grace_cpus_without_smt(make_node: NodeFactory) -> None:
    """A GB200 NVL72 tray: GPUs 0-1 on the first Grace (NUMA 0, CPUs 0-71), 2-3 on the
    second (72-143); 18 NVLink 5 links per GPU, every one to an NVSwitch."""
    nvml = make_node("gb200-nvl72").nvml
    for index in range(4):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        numa = nvml.nvmlDeviceGetNumaNodeId(handle)
        assert numa == index // 2
        words = nvml.nvmlDeviceGetCpuAffinity(handle, 4)
        cpus = {w * 64 + b for w in range(4) for b in range(64) if words[w] >> b & 1}
        assert cpus == set(range(72 * numa, 72 * numa + 72))
        for link in range(18):
            assert nvml.nvmlDeviceGetNvLinkVersion(handle, link) == 7  # NVLink 5.0
            assert nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == (
                pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetNvLinkState(handle, 18)


def test_unknown_preset_names_the_known_ones() -> None:
    """An unknown preset is an InvalidRequest that lists every preset."""
    with pytest.raises(InvalidRequest) as excinfo:
        get_preset("dgx-b300")
    for name in preset_names():
        assert name in excinfo.value.detail
    assert set(preset_names()) == {"dgx-a100", "dgx-h100", "hgx-h200", "a100-pcie-bridged",
                                   "l40s", "dgx-a100-r535", "gb200-nvl72"}


def _ci_profiles(node: SimulatedNode, gi: Any) -> dict[int, tuple[int, int, int]]:
    """CI profile id -> (slices, instances, SMs) for every CI index constant the GI offers."""
    found = {}
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = node.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except pynvml.NVMLError_NotSupported:
            continue
        assert info.id == index
        found[index] = (info.sliceCount, info.instanceCount, info.multiprocessorCount)
    return found


# GI profile id -> CI profile id -> (slices, instances, SMs)
H100_CI = {
    19: {0: (1, 1, 16)},
    20: {0: (1, 1, 16)},
    15: {0: (1, 1, 16), 7: (1, 1, 26)},
    14: {0: (1, 2, 16), 1: (2, 1, 32), 7: (1, 1, 26)},
    9: {0: (1, 3, 16), 1: (2, 1, 32), 2: (3, 1, 60)},
    5: {0: (1, 4, 16), 1: (2, 2, 32), 3: (4, 1, 64)},
    0: {0: (1, 7, 16), 1: (2, 3, 32), 2: (3, 2, 48), 3: (4, 1, 64), 4: (7, 1, 132)},
}
A100_CI = {
    19: {0: (1, 1, 14), 7: (1, 1, 14)},
    20: {0: (1, 1, 14), 7: (1, 1, 14)},
    15: {0: (1, 1, 14), 7: (1, 1, 14)},
    14: {0: (1, 2, 14), 1: (2, 1, 28), 7: (1, 2, 14)},
    9: {0: (1, 3, 14), 1: (2, 1, 28), 2: (3, 1, 42), 7: (1, 3, 14)},
    5: {0: (1, 4, 14), 1: (2, 2, 28), 3: (4, 1, 56), 7: (1, 4, 14)},
    0: {0: (1, 7, 14), 1: (2, 3, 28), 2: (3, 2, 42), 3: (4, 1, 56), 4: (7, 1, 98),
        7: (1, 7, 14)},
}
CI_ROWS = [("dgx-h100", gi, t) for gi, t in H100_CI.items()] + [
    ("dgx-a100", gi, t) for gi, t in A100_CI.items()]


@pytest.mark.parametrize(("preset", "gi_profile", "expected"), CI_ROWS,
                         ids=[f"{p}-gi{g}" for p, g, _ in CI_ROWS])
def test_compute_instance_profiles_per_gpu_instance(
        make_node: NodeFactory, preset: str, gi_profile: int,
        expected: dict[int, tuple[int, int, int]]) -> None:
    """Each GI offers the real CI profiles (REV1 included: Hopper 1g.20gb/2g with 26 SM,
    Ampere everywhere mirroring 1c), with their slices, instance counts and SMs."""
    node = make_node(preset)
    gi = create_gi(node, enable_mig(node), gi_profile)
    assert _ci_profiles(node, gi) == expected


def test_h100_rev2_gi_max_sm_ci_is_not_the_first(h100: SimulatedNode) -> None:
    """On H100 1g.20gb the first CI profile has 16 SM, the max-SM one (REV1, id 7) has 26."""
    gi = create_gi(h100, enable_mig(h100), 15)
    profiles = _ci_profiles(h100, gi)
    first = next(iter(profiles))
    best = max(profiles, key=lambda p: profiles[p][2])
    assert (first, profiles[first][2]) == (0, 16)
    assert (best, profiles[best][2]) == (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1, 26)
    ci = h100.nvml.nvmlGpuInstanceCreateComputeInstance(gi, best)
    mig = h100.nvml.nvmlDeviceGetMigDeviceHandleByIndex(enable_mig(h100), 0)
    assert h100.nvml.nvmlDeviceGetAttributes(mig).multiprocessorCount == 26
    assert h100.nvml.nvmlComputeInstanceGetInfo(ci).profileId == best


@pytest.mark.parametrize(("gi_profile", "ci_profile", "placements"), [
    (0, 0, [(s, 1) for s in range(7)]),
    (0, 1, [(0, 2), (2, 2), (4, 2)]),
    (0, 2, [(0, 3), (4, 3)]),
    (0, 3, [(0, 4)]),
    (0, 4, [(0, 7)]),
    (9, 2, [(0, 3)]),
    (9, 1, [(0, 2)]),
    (5, 1, [(0, 2), (2, 2)]),
    (14, 0, [(0, 1), (1, 1)]),
])
def test_compute_instance_placements(h100: SimulatedNode, gi_profile: int, ci_profile: int,
                                     placements: list[tuple[int, int]]) -> None:
    """CI placements within a GI follow nvidia-smi mig -lcipp."""
    gi = create_gi(h100, enable_mig(h100), gi_profile)
    array = (pynvml.c_nvmlComputeInstancePlacement_t * 8)()
    count = ctypes.c_uint(8)
    h100.nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, ci_profile, array,
                                                                  ctypes.byref(count))
    assert [(p.start, p.size) for p in array[: count.value]] == placements


def test_ci_profile_info_rejects_bad_engine_profile_and_version(h100: SimulatedNode) -> None:
    """Engine profile other than SHARED is INVALID_ARGUMENT; version 3 is FUNCTION_NOT_FOUND."""
    gi = create_gi(h100, enable_mig(h100), 0)
    with pytest.raises(pynvml.NVMLError) as excinfo:
        h100.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 1)
    assert nvml_code(excinfo) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        h100.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0, version=3)
    v1 = h100.nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 4, 0, version=1)
    assert isinstance(v1, pynvml.c_nvmlComputeInstanceProfileInfo_t)
    assert (v1.multiprocessorCount, v1.sharedCopyEngineCount) == (132, 8)
