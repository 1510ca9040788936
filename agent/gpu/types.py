"""What the hardware layer reports: immutable values, built in NVML worker threads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """A run of memory slices: ``start`` is the first slice, ``size`` the number of slices."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class MigMode:
    current: bool
    pending: bool


@dataclass(frozen=True)
class Health:
    healthy: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile as NVML reports it (``id`` is the device profile ID, e.g. 19)."""

    id: int
    index: int
    name: str
    slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    max_instances: int
    placements: tuple[Placement, ...] = ()
    media_extensions: bool = False


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance inside a GPU instance)."""

    index: int
    uuid: str
    profile: str
    gi_id: int
    ci_id: int
    placement: Placement
    memory_mib: int
    multiprocessors: int


@dataclass(frozen=True)
class GpuStatic:
    """Attributes that do not change while the driver stays loaded."""

    index: int
    minor: int
    uuid: str
    name: str
    brand: str
    architecture: str
    cuda_compute_capability: str
    pci_bus_id: str
    pci_device_id: int
    pci_subsystem_id: int
    memory_total_mib: int
    numa_node: int | None
    cpu_affinity: str
    mig_capable: bool


@dataclass(frozen=True)
class Gpu:
    """A GPU as last read: static attributes plus MIG state and health."""

    static: GpuStatic
    mig_mode: MigMode | None
    mig_devices: tuple[MigDevice, ...]
    health: Health
    profiles: tuple[GiProfile, ...] = field(default=())

    @property
    def uuid(self) -> str:
        return self.static.uuid

    @property
    def index(self) -> int:
        return self.static.index


@dataclass(frozen=True)
class ComputeInstanceState:
    id: int
    profile_id: int
    placement: Placement


@dataclass(frozen=True)
class GpuInstanceState:
    """A GPU instance as NVML lists it, with its compute instances (possibly none)."""

    id: int
    profile_id: int
    placement: Placement
    compute_instances: tuple[ComputeInstanceState, ...]


@dataclass(frozen=True)
class GpuProcess:
    """A compute process; ``gi_id``/``ci_id`` say which MIG device it runs on, if any."""

    pid: int
    used_memory_mib: int
    gi_id: int | None
    ci_id: int | None


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str
    cuda_driver_version: str
    nvml_version: str
