"""The simulated nodes: GPU models with real MIG tables (``reference/mig.md`` §1.2, §1.5, §1.6)
and whole-node presets (GPU count, PCI bus ids, NUMA layout, CPUs, the driver they run)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from agent.errors import InvalidRequest
from agent.gpu.naming import mig_profile_name
from agent.gpu.sim.naming import compute_instance_name

Architecture = Literal["ampere", "hopper", "ada", "blackwell"]

# NVML_COMPUTE_INSTANCE_PROFILE_* constants by CI slice count, and the REV1 one.
CI_PROFILE_BY_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4}
CI_PROFILE_1_SLICE_REV1 = 0x7
# Which CI sizes a GI of g compute slices offers (nvidia-smi mig -lcip on A100/H100).
_CI_SIZES = {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}
# NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: "1 slice with twice the memory" (1g.20gb on H100).
GI_PROFILE_1_SLICE_REV2 = 0x9


@dataclass(frozen=True)
class Engines:
    """Engine counts of a GPU-instance profile (shared by every CI inside it)."""

    copy: int
    decoder: int
    encoder: int
    jpeg: int
    ofa: int


@dataclass(frozen=True)
class GiProfile:
    """One GPU-instance profile of a GPU model, as ``nvidia-smi mig -lgip/-lgipp`` shows it."""

    id: int
    """Device profile ID (19, 20, 15, 14, 9, 5, 0): what create/placement calls take."""
    index: int
    """The NVML_GPU_INSTANCE_PROFILE_* constant that ProfileInfo is asked with."""
    slices: int
    memory_mib: int
    multiprocessors: int
    engines: Engines
    instance_count: int
    starts: tuple[int, ...]
    size: int
    """Memory slices one instance occupies (a 3g takes 4, a 7g takes 8)."""
    gi_ids: tuple[int, ...]
    """GI id the driver assigns to an instance at each of ``starts`` (same order)."""
    auto_order: tuple[int, ...]
    """Starts in the order driver auto-placement tries them (not first-fit)."""
    media_extensions: bool = False

    def name(self, total_mib: int) -> str:
        return mig_profile_name(self.slices, self.memory_mib, total_mib,
                                media_extensions=self.media_extensions)

    def gi_id_at(self, start: int) -> int:
        return self.gi_ids[self.starts.index(start)]


@dataclass(frozen=True)
class CiProfile:
    """One compute-instance profile available inside a GPU instance of a given profile."""

    id: int
    """The NVML_COMPUTE_INSTANCE_PROFILE_* constant; NVML reports it as ``info.id``."""
    slices: int
    instance_count: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...]
    name: str


@dataclass(frozen=True)
class GpuModel:
    """A GPU SKU: identity, memory, MIG tables and the numbers telemetry moves between."""

    name: str
    architecture: Architecture
    cuda_capability: tuple[int, int]
    memory_mib: int
    multiprocessors: int
    pci_device_id: int
    pci_subsystem_id: int
    idle_power_w: int
    tdp_w: int
    sm_clock_idle_mhz: int
    sm_clock_max_mhz: int
    mem_clock_mhz: int
    idle_temp_c: int
    load_temp_c: int
    sm_per_slice: int = 0
    gi_profiles: tuple[GiProfile, ...] = ()
    rev1_ci_multiprocessors: int = 0
    """Hopper: SMs of the REV1 CI in the 1g REV2 and 2g GIs; 0 on Ampere, where REV1 mirrors
    the 1-slice CI in every GI."""
    nvlinks: int = 0
    """NVLink links per GPU (12 on A100, 18 on H100/H200, none on L40S)."""
    nvlink_version: int = 0
    """``nvmlNvlinkVersion_t`` the links report (4 = NVLink 3.0 on A100, 6 = 4.0 on Hopper)."""
    pcie_generation: int = 4
    pcie_width: int = 16
    hbm: bool = True
    """HBM memory, which has a temperature sensor NVML reports (GDDR boards answer
    NOT_SUPPORTED for ``NVML_FI_DEV_MEMORY_TEMP``)."""
    encoders: int = 0
    """NVENC engines (none on A100/H100/H200, whose encoder utilisation reads 0 %)."""
    decoders: int = 0
    """NVDEC engines."""

    @property
    def gpm(self) -> bool:
        """GPU performance monitoring (``nvmlGpm*``): Hopper and later only."""
        return self.architecture in ("hopper", "blackwell")

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    @property
    def mig_mode_needs_reset(self) -> bool:
        """Ampere leaves a MIG mode change pending until a GPU reset; Hopper applies it."""
        return self.architecture == "ampere"

    @property
    def mig_mode_survives_reload(self) -> bool:
        """Ampere keeps MIG mode in the InfoROM; Hopper forgets it on driver reload."""
        return self.architecture == "ampere"

    def gi_profile(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def gi_profile_by_index(self, index: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.index == index), None)

    def ci_profiles(self, gi: GiProfile) -> tuple[CiProfile, ...]:
        """The CI profiles a GI of this profile offers, REV1 included where the SKU has it."""
        return _ci_profiles(self, gi)

    def ci_profile(self, gi: GiProfile, profile_id: int) -> CiProfile | None:
        return next((p for p in self.ci_profiles(gi) if p.id == profile_id), None)


@functools.cache
def _ci_profiles(model: GpuModel, gi: GiProfile) -> tuple[CiProfile, ...]:
    """GpuModel.ci_profiles, computed once per (model, GI profile)."""
    gi_name = gi.name(model.memory_mib)
    rev2 = gi.index == GI_PROFILE_1_SLICE_REV2
    profiles: list[CiProfile] = []
    for c in _CI_SIZES[gi.slices]:
        # The CI spanning the GI gets all of the GI's SMs (3g = 60 on H100, not 48), except
        # in Hopper's REV2 GI, where the plain 1c CI gets one slice's SMs (16 of 26) and
        # the REV1 CI is the one that gets them all.
        whole = c == gi.slices and not (rev2 and model.rev1_ci_multiprocessors)
        placements = _ci_placements(c, gi.slices)
        sms = gi.multiprocessors if whole else c * model.sm_per_slice
        profiles.append(CiProfile(
            id=CI_PROFILE_BY_SLICES[c], slices=c, instance_count=len(placements),
            multiprocessors=sms, placements=placements,
            name=compute_instance_name(c, gi_name, whole=whole)))
    rev1_name = compute_instance_name(1, gi_name, whole=rev2)
    if model.rev1_ci_multiprocessors == 0:
        # Ampere: REV1 mirrors the 1-slice CI in every GI.
        one = profiles[0]
        profiles.append(CiProfile(
            id=CI_PROFILE_1_SLICE_REV1, slices=1, instance_count=one.instance_count,
            multiprocessors=one.multiprocessors, placements=one.placements, name=one.name))
    elif rev2 or gi.slices == 2:
        # More SMs than one slice holds, so it cannot share the GI: it occupies all of it.
        profiles.append(CiProfile(
            id=CI_PROFILE_1_SLICE_REV1, slices=1, instance_count=1,
            multiprocessors=model.rev1_ci_multiprocessors,
            placements=((0, gi.slices),), name=rev1_name))
    return tuple(profiles)


def _ci_placements(c: int, g: int) -> tuple[tuple[int, int], ...]:
    """Compute-slice placements of a c-slice CI in a g-slice GI (``nvidia-smi mig -lcipp``)."""
    if c == 1:
        return tuple((s, 1) for s in range(g))
    if c == 2:
        return tuple((s, 2) for s in (0, 2, 4) if s + 2 <= g)
    if c == 3:
        return ((0, 3), (4, 3)) if g == 7 else ((0, 3),)
    return ((0, c),)


@dataclass(frozen=True)
class CpuLayout:
    """Sockets with SMT; one NUMA node per socket, Linux numbering (all first threads, then
    all second threads), so NUMA 0 of 2x56 cores is CPUs 0-55 and 112-167."""

    sockets: int
    cores_per_socket: int
    threads_per_core: int = 2

    @property
    def cpu_count(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads_per_core

    def numa_cpus(self, node: int) -> tuple[int, ...]:
        cores = self.sockets * self.cores_per_socket
        first = node * self.cores_per_socket
        return tuple(t * cores + c for t in range(self.threads_per_core)
                     for c in range(first, first + self.cores_per_socket))


@dataclass(frozen=True)
class Driver:
    """The NVIDIA driver a simulated node runs: the versions NVML reports, and whether the
    branch reports NVML's recovery action (``reference/health.md``)."""

    version: str
    cuda_version: int
    """``nvmlSystemGetCudaDriverVersion``: 12080 is CUDA 12.8."""
    recovery_action: bool
    """Field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (230), the deprecated reset-status
    fields 226/227 and ``nvmlEventTypeGpuRecoveryAction``: recent data-center branches
    report them; older ones answer NOT_SUPPORTED for the fields and lack the event."""

    @property
    def nvml_version(self) -> str:
        """``nvmlSystemGetNVMLVersion``: the CUDA major version, then the driver's."""
        return f"{self.cuda_version // 1000}.{self.version}"


#: What every preset runs unless it says otherwise.
R570 = Driver(version="570.133.20", cuda_version=12080, recovery_action=True)
#: The R535 long-term branch, from before NVML had the recovery action.
R535 = Driver(version="535.247.01", cuda_version=12020, recovery_action=False)


@dataclass(frozen=True)
class Preset:
    """A whole simulated node."""

    name: str
    description: str
    gpu: GpuModel
    bus_numbers: tuple[int, ...]
    """PCI bus of each GPU (domain 0, device 0, function 0); its length is the GPU count."""
    numa_nodes: tuple[int, ...]
    cpus: CpuLayout
    nvswitch: bool = False
    nvlink_bridges: tuple[tuple[int, int], ...] = ()
    """GPU index pairs joined by NVLink bridges (every link of both GPUs goes to the peer)."""
    switch_of_link: tuple[int, ...] = ()
    """With NVSwitch: which switch (index into ``switch_bus_numbers``) each GPU link reaches;
    the same wiring on every GPU, as on HGX baseboards."""
    switch_bus_numbers: tuple[int, ...] = ()
    """PCI bus of each NVSwitch (domain 0, device 0, function 0)."""
    pcie_switches: tuple[int, ...] = ()
    """PCIe switch of each GPU; GPUs sharing one meet below the host bridge (PXB). Empty:
    every GPU has its own."""
    fabric: tuple[str, int] | None = None
    """Multi-node NVLink (cluster UUID, clique id) every GPU reports when its fabric is
    healthy (``--sim-cluster-uuid``/``--sim-clique-id`` replace it); None: no multi-node
    NVLink, where Hopper on NVSwitch reports a completed fabric with a zero UUID."""
    driver: Driver = R570

    @property
    def gpu_count(self) -> int:
        return len(self.bus_numbers)

    @property
    def fabric_capable(self) -> bool:
        """Whether NVML answers ``nvmlDeviceGetGpuFabricInfo(V)``: nvml.h says Hopper and
        newer, and only GPUs the fabric manager registers, i.e. on NVSwitch (a lone or
        PCIe-bridged GPU answers NOT_SUPPORTED, ``reference/topology.md`` 2.5)."""
        return self.nvswitch and self.gpu.architecture in ("hopper", "blackwell")


def _gi(profile_id: int, index: int, slices: int, *, mib: int, sms: int, engines: Engines,
        me: bool = False) -> GiProfile:
    """A GI profile row; placements, GI ids and auto-placement order follow from the id."""
    layout = _PLACEMENT_TABLE[profile_id]
    return GiProfile(id=profile_id, index=index, slices=slices, memory_mib=mib,
                     multiprocessors=sms, engines=engines,
                     # One +me instance at most: the GPU has one set of media engines.
                     instance_count=1 if me else len(layout[0]),
                     starts=layout[0], size=layout[1], gi_ids=layout[2], auto_order=layout[3],
                     media_extensions=me)


# Device profile id -> (starts, size, GI ids per start, auto-placement order). Placements are
# the real -lgipp output (identical on A100 and H100); GI ids follow the MIG guide's examples
# (1g slot s -> 7+s, 2g 0/2/4 -> 3/4/5); the 1g auto order 6,4,5,0,1,2,3 and 2g -> 4:2 first are
# observed, the other orders are the same "upper half first" habit.
_PLACEMENT_TABLE: dict[int, tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]] = {
    19: ((0, 1, 2, 3, 4, 5, 6), 1, (7, 8, 9, 10, 11, 12, 13), (6, 4, 5, 0, 1, 2, 3)),
    20: ((0, 1, 2, 3, 4, 5, 6), 1, (7, 8, 9, 10, 11, 12, 13), (6, 4, 5, 0, 1, 2, 3)),
    15: ((0, 2, 4, 6), 2, (3, 4, 5, 6), (4, 6, 0, 2)),
    14: ((0, 2, 4), 2, (3, 4, 5), (4, 0, 2)),
    9: ((0, 4), 4, (1, 2), (4, 0)),
    5: ((0,), 4, (1,), (0,)),
    0: ((0,), 8, (0,), (0,)),
}


def _ampere_profiles(one: int, two: int, four: int, seven: int) -> tuple[GiProfile, ...]:
    """A100 rows (MIG guide, A100-SXM4-40GB); memory in MiB per SKU for the 1-, 2-, 4- and
    8-memory-slice profiles (1g REV2 has 2g's memory, 3g has 4g's)."""
    return (
        _gi(19, 0x0, 1, mib=one, sms=14, engines=Engines(1, 0, 0, 0, 0)),
        _gi(20, 0x7, 1, mib=one, sms=14, engines=Engines(1, 1, 0, 1, 1), me=True),
        _gi(15, 0x9, 1, mib=two, sms=14, engines=Engines(1, 1, 0, 0, 0)),
        _gi(14, 0x1, 2, mib=two, sms=28, engines=Engines(2, 1, 0, 0, 0)),
        _gi(9, 0x2, 3, mib=four, sms=42, engines=Engines(3, 2, 0, 0, 0)),
        _gi(5, 0x3, 4, mib=four, sms=56, engines=Engines(4, 2, 0, 0, 0)),
        _gi(0, 0x4, 7, mib=seven, sms=98, engines=Engines(7, 5, 0, 1, 1)),
    )


def _hopper_profiles(one: int, two: int, four: int, seven: int) -> tuple[GiProfile, ...]:
    """H100/H200 rows (published -lgip captures): REV2 has 26 SM, 3g 60, 7g 132."""
    return (
        _gi(19, 0x0, 1, mib=one, sms=16, engines=Engines(1, 1, 0, 1, 0)),
        _gi(20, 0x7, 1, mib=one, sms=16, engines=Engines(1, 1, 0, 1, 1), me=True),
        _gi(15, 0x9, 1, mib=two, sms=26, engines=Engines(1, 1, 0, 1, 0)),
        _gi(14, 0x1, 2, mib=two, sms=32, engines=Engines(2, 2, 0, 2, 0)),
        _gi(9, 0x2, 3, mib=four, sms=60, engines=Engines(3, 3, 0, 3, 0)),
        _gi(5, 0x3, 4, mib=four, sms=64, engines=Engines(4, 4, 0, 4, 0)),
        _gi(0, 0x4, 7, mib=seven, sms=132, engines=Engines(8, 7, 0, 7, 1)),
    )


def _blackwell_profiles(one: int, two: int, four: int, seven: int) -> tuple[GiProfile, ...]:
    """GB200 rows: the 1g/1g+me/1g.47gb/2g SMs and engines of the published B200/GB200
    captures (``reference/mig.md`` 1.5: 1g 18 SM, 1g.47gb 32 SM, 2g.47gb 38 SM, two copy
    engines from 1g up); the 3g/4g/7g SMs and the copy engines past 2g (the MIG guide's
    B200 column: 6, 8, 16) are cut off in every capture found, so are assumed: verify on
    hardware."""
    return (
        _gi(19, 0x0, 1, mib=one, sms=18, engines=Engines(2, 1, 0, 1, 0)),
        _gi(20, 0x7, 1, mib=one, sms=18, engines=Engines(2, 1, 0, 1, 1), me=True),
        _gi(15, 0x9, 1, mib=two, sms=32, engines=Engines(2, 1, 0, 1, 0)),
        _gi(14, 0x1, 2, mib=two, sms=38, engines=Engines(4, 2, 0, 2, 0)),
        _gi(9, 0x2, 3, mib=four, sms=72, engines=Engines(6, 3, 0, 3, 0)),
        _gi(5, 0x3, 4, mib=four, sms=76, engines=Engines(8, 4, 0, 4, 0)),
        _gi(0, 0x4, 7, mib=seven, sms=152, engines=Engines(16, 7, 0, 7, 1)),
    )


def _gib(shown: float) -> int:
    """MiB from the GiB ``nvidia-smi mig -lgip`` shows: sizes are whole eighths of a GiB
    printed with two decimals, so 19.62 means 19.625 GiB = 20096 MiB."""
    return round(shown * 8) * 128


# PCI device ids are the real ones (gpu-operator's table); subsystem ids are plausible board
# ids for these systems, not checked against hardware.
A100_SXM4_40GB = GpuModel(
    name="NVIDIA A100-SXM4-40GB", architecture="ampere", cuda_capability=(8, 0),
    memory_mib=40960, multiprocessors=108, pci_device_id=0x20B010DE,
    pci_subsystem_id=0x145F10DE, idle_power_w=55, tdp_w=400, sm_clock_idle_mhz=210,
    sm_clock_max_mhz=1410, mem_clock_mhz=1215, idle_temp_c=30, load_temp_c=68,
    sm_per_slice=14, nvlinks=12, nvlink_version=4, decoders=5,
    gi_profiles=_ampere_profiles(4864, 9856, 19968, 40192),
)

A100_80GB_PCIE = GpuModel(
    name="NVIDIA A100 80GB PCIe", architecture="ampere", cuda_capability=(8, 0),
    memory_mib=81920, multiprocessors=108, pci_device_id=0x20B510DE,
    pci_subsystem_id=0x153310DE, idle_power_w=45, tdp_w=300, sm_clock_idle_mhz=210,
    sm_clock_max_mhz=1410, mem_clock_mhz=1512, idle_temp_c=34, load_temp_c=74,
    sm_per_slice=14, nvlinks=12, nvlink_version=4, decoders=5,
    gi_profiles=_ampere_profiles(_gib(9.75), _gib(19.62), _gib(39.25), _gib(79.12)),
)

H100_80GB_HBM3 = GpuModel(
    name="NVIDIA H100 80GB HBM3", architecture="hopper", cuda_capability=(9, 0),
    memory_mib=81559, multiprocessors=132, pci_device_id=0x233010DE,
    pci_subsystem_id=0x16C110DE, idle_power_w=70, tdp_w=700, sm_clock_idle_mhz=345,
    sm_clock_max_mhz=1980, mem_clock_mhz=2619, idle_temp_c=32, load_temp_c=71,
    sm_per_slice=16, rev1_ci_multiprocessors=26, nvlinks=18, nvlink_version=6,
    pcie_generation=5, decoders=7,
    # 3g/4g.40gb: the MIG guide's 40448 MiB (39.50 GiB).
    gi_profiles=_hopper_profiles(_gib(9.75), _gib(19.62), 40448, _gib(79.25)),
)

H200 = GpuModel(
    name="NVIDIA H200", architecture="hopper", cuda_capability=(9, 0),
    memory_mib=143771, multiprocessors=132, pci_device_id=0x233510DE,
    pci_subsystem_id=0x18A410DE, idle_power_w=75, tdp_w=700, sm_clock_idle_mhz=345,
    sm_clock_max_mhz=1980, mem_clock_mhz=3201, idle_temp_c=31, load_temp_c=70,
    sm_per_slice=16, rev1_ci_multiprocessors=26, nvlinks=18, nvlink_version=6,
    pcie_generation=5, decoders=7,
    # Driver 580.159.04 on a real H200 (tests/data/hardware/): 256 MiB more from 2 slices up
    # than mig-parted #120's older capture (32.25, 69.50, 139.75 GiB); the names are the same.
    gi_profiles=_hopper_profiles(_gib(16.00), _gib(32.50), _gib(69.75), _gib(140.00)),
)

# One GPU of a GB200 superchip. The MIG names (1g.23gb, 1g.47gb, 2g.47gb, 3g.93gb, 4g.93gb,
# 7g.186gb) are the ones NVIDIA's tools use for GB200; the total (189471 MiB, which names 7g as
# 186gb), the per-profile MiB, the SM count and the clocks are not from a published capture:
# verify on hardware. Placements are the 8-slice table of every 7-slice GPU (mig.md 1.2 says
# the same for B200). NVLink 5 (nvmlNvlinkVersion_t 7), 18 links, all to the rack's switch
# trays.
GB200 = GpuModel(
    name="NVIDIA GB200", architecture="blackwell", cuda_capability=(10, 0),
    memory_mib=189471, multiprocessors=152, pci_device_id=0x294110DE,
    pci_subsystem_id=0x199910DE, idle_power_w=160, tdp_w=1200, sm_clock_idle_mhz=345,
    sm_clock_max_mhz=1965, mem_clock_mhz=3996, idle_temp_c=30, load_temp_c=68,
    sm_per_slice=18, rev1_ci_multiprocessors=32, nvlinks=18, nvlink_version=7,
    pcie_generation=5, decoders=7,
    gi_profiles=_blackwell_profiles(_gib(23.00), _gib(46.00), _gib(92.25), _gib(184.50)),
)

L40S = GpuModel(
    name="NVIDIA L40S", architecture="ada", cuda_capability=(8, 9),
    memory_mib=46068, multiprocessors=142, pci_device_id=0x26B910DE,
    pci_subsystem_id=0x185110DE, idle_power_w=35, tdp_w=350, sm_clock_idle_mhz=210,
    sm_clock_max_mhz=2520, mem_clock_mhz=9001, idle_temp_c=29, load_temp_c=76,
    hbm=False, encoders=3, decoders=3,
)

_DGX_NUMA = (0, 0, 0, 0, 1, 1, 1, 1)
# DGX A100: six NVSwitches, two links of every GPU to each; GPU pairs share a PCIe switch.
_A100_SWITCH_OF_LINK = (0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5)
_A100_SWITCH_BUSES = (0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9)
# HGX H100/H200: four NVSwitches; GPU0's links 0,1,4,5,10 / 2,3,6,7,11 / 8,9,14,15 /
# 12,13,16,17 reach them (nvidia-smi nvlink -R, reference topology.md 2.3).
_HOPPER_SWITCH_OF_LINK = (0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 3, 3, 2, 2, 3, 3)
_HOPPER_SWITCH_BUSES = (0x07, 0x06, 0x05, 0x08)

# GB200 NVL72: 18 compute trays of two Grace CPUs (72 cores each, no SMT) and four GPUs, two
# per Grace; every GPU link goes to one of the 18 NVSwitch chips of the 9 switch trays, which
# have no PCI address on the host (topology.md 2.3: NCCL sees fffffff:ff:ff.0). Real trays put
# each GPU in a PCI domain of its own (0008:01:00.0, 0009:01:00.0, ...); the simulator keeps
# domain 0 with one bus per GPU. The default fabric is one healthy rack: every agent started
# without --sim-cluster-uuid/--sim-clique-id is in the same clique.
_NVL72_SWITCH_OF_LINK = tuple(range(18))
_NVL72_SWITCH_BUSES = (0xFF,) * 18
NVL72_CLUSTER_UUID = "6e766c37-3200-4000-8000-000000000001"
NVL72_CLIQUE_ID = 1

_DGX_A100 = Preset(
    name="dgx-a100", description="DGX A100: 8x A100-SXM4-40GB on NVSwitch (NV12)",
    gpu=A100_SXM4_40GB, bus_numbers=(0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD),
    numa_nodes=_DGX_NUMA, cpus=CpuLayout(sockets=2, cores_per_socket=64),
    nvswitch=True, switch_of_link=_A100_SWITCH_OF_LINK,
    switch_bus_numbers=_A100_SWITCH_BUSES, pcie_switches=(0, 0, 1, 1, 2, 2, 3, 3))

PRESETS: dict[str, Preset] = {p.name: p for p in (
    _DGX_A100,
    # The same node on the R535 branch: no recovery action, so the XID table decides.
    dataclasses.replace(_DGX_A100, name="dgx-a100-r535", driver=R535,
                        description="DGX A100 on the R535 driver (no NVML recovery action)"),
    Preset(name="dgx-h100", description="DGX H100: 8x H100 80GB HBM3 on NVSwitch (NV18)",
           gpu=H100_80GB_HBM3,
           bus_numbers=(0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF),
           numa_nodes=_DGX_NUMA, cpus=CpuLayout(sockets=2, cores_per_socket=56),
           nvswitch=True, switch_of_link=_HOPPER_SWITCH_OF_LINK,
           switch_bus_numbers=_HOPPER_SWITCH_BUSES),
    Preset(name="hgx-h200", description="HGX H200: 8x H200 141GB on NVSwitch (NV18)",
           gpu=H200,
           bus_numbers=(0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF),
           numa_nodes=_DGX_NUMA, cpus=CpuLayout(sockets=2, cores_per_socket=56),
           nvswitch=True, switch_of_link=_HOPPER_SWITCH_OF_LINK,
           switch_bus_numbers=_HOPPER_SWITCH_BUSES),
    Preset(name="a100-pcie-bridged",
           description="8x A100 80GB PCIe, NVLink bridges on pairs 0-2, 1-3, 4-5, 6-7",
           gpu=A100_80GB_PCIE,
           bus_numbers=(0x17, 0x31, 0x4B, 0x65, 0x98, 0xB1, 0xCA, 0xE3),
           numa_nodes=_DGX_NUMA, cpus=CpuLayout(sockets=2, cores_per_socket=32),
           nvlink_bridges=((0, 2), (1, 3), (4, 5), (6, 7))),
    Preset(name="gb200-nvl72",
           description="GB200 NVL72 compute tray: 4x GB200 (NV18 to the rack's NVSwitch "
                       "trays), multi-node NVLink fabric",
           gpu=GB200, bus_numbers=(0x01, 0x02, 0x11, 0x12), numa_nodes=(0, 0, 1, 1),
           cpus=CpuLayout(sockets=2, cores_per_socket=72, threads_per_core=1),
           nvswitch=True, switch_of_link=_NVL72_SWITCH_OF_LINK,
           switch_bus_numbers=_NVL72_SWITCH_BUSES,
           fabric=(NVL72_CLUSTER_UUID, NVL72_CLIQUE_ID)),
    Preset(name="l40s", description="4x L40S, no MIG, no NVLink", gpu=L40S,
           bus_numbers=(0x17, 0x31, 0xB1, 0xCA), numa_nodes=(0, 0, 1, 1),
           cpus=CpuLayout(sockets=2, cores_per_socket=32)),
)}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; :class:`InvalidRequest` naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise InvalidRequest(
            f"unknown simulator preset {name!r}; known presets: {known}",
            errors=[{"field": "preset", "reason": f"must be one of: {known}"}]) from None
