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


# nvmlGpuFabricState_t values (0, NOT_SUPPORTED, is never kept: the GPU has no fabric then).
FABRIC_STATES = {1: "not_started", 2: "in_progress", 3: "completed"}
_FABRIC_COMPLETED = 3
_NVML_SUCCESS = 0


@dataclass(frozen=True)
class Fabric:
    """``nvmlGpuFabricInfo(V)``: the multi-node NVLink domain a GPU belongs to, as last read."""

    cluster_uuid: str
    clique_id: int
    state: int
    status: int
    """The NVML return code of the GPU's fabric registration (valid once COMPLETED)."""
    status_name: str = "NVML_SUCCESS"
    health_mask: int | None = None
    """The raw health mask; None where only the unversioned call (no mask) answered."""
    health: tuple[str, ...] = ()
    """What the health mask flags (``degraded_bandwidth``, ``route_unhealthy``, ...)."""

    @property
    def state_name(self) -> str:
        return FABRIC_STATES.get(self.state, f"unknown({self.state})")

    @property
    def clique(self) -> str | None:
        """``"<cluster UUID>.<clique id>"`` when the fabric is usable: state COMPLETED, status
        SUCCESS and a non-zero cluster UUID (the NVIDIA DRA driver's rule); None otherwise."""
        if (self.state != _FABRIC_COMPLETED or self.status != _NVML_SUCCESS
                or set(self.cluster_uuid) <= {"0", "-"}):
            return None
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True)
class Gpu:
    """A GPU as last read: static attributes plus MIG state, health and NVLink fabric."""

    static: GpuStatic
    mig_mode: MigMode | None
    mig_devices: tuple[MigDevice, ...]
    health: Health
    profiles: tuple[GiProfile, ...] = field(default=())
    fabric: Fabric | None = None
    """None where NVML answers NOT_SUPPORTED (no NVLink fabric), or the read failed."""

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
