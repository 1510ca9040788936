"""Request and response models of the REST API; ``/openapi.json`` is generated from these."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, RootModel
from pydantic_core import CoreSchema

from agent.events import Event
from agent.gpu.types import DriverInfo, Fabric, Gpu, MigDevice
from agent.health.taints import Taint
from agent.ledger.ledger import Availability, Hold, NodeLedger
from agent.logs import iso_time


class Strict(BaseModel):
    """Requests reject unknown fields, so a typo is an error rather than a silent default, and
    take each field in its one JSON type: ``"60"`` is not a number, ``"false"`` not a
    boolean, ``true`` not a count (strict mode; bodies are validated from their JSON text)."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class OneOf:
    """Marks a union field of a request (``Annotated[int | str, OneOf("...")]``): a value
    no member takes is one error at the field itself, with ``message``. pydantic would report
    an error per member, each under the member's type name (``must_include[1].int``,
    ``must_include[1].str``): paths no client can match to a field it sent."""

    message: str

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        """The union's schema, with one error of its own."""
        schema = handler(source)
        if schema["type"] != "union":
            raise TypeError(f"OneOf marks a union, not a {schema['type']} schema")
        return cast("CoreSchema", {**schema, "custom_error_type": "union_refused",
                                   "custom_error_message": self.message})


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    request_id: str | None = None
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="For validation errors: each offending field and why")


class Status(BaseModel):
    status: Literal["ok", "ready", "not ready"]
    reason: str | None = None


class PlacementModel(BaseModel):
    start: int = Field(description="First memory slice")
    size: int = Field(description="Number of memory slices")


class MigModeModel(BaseModel):
    current: bool
    pending: bool


class HealthModel(BaseModel):
    healthy: bool
    reasons: list[str]


class FabricModel(BaseModel):
    """The GPU's multi-node NVLink fabric (``nvmlDeviceGetGpuFabricInfoV``)."""

    state: str = Field(description="not_started, in_progress or completed: the fabric "
                       "manager's registration of the GPU")
    status: str = Field(description="NVML_SUCCESS, or the NVML error registration ended with "
                        "(meaningful once completed)")
    cluster_uuid: str | None = Field(description="The NVLink domain's cluster UUID; null "
                                     "while it is all zeros (no multi-node NVLink)")
    clique_id: int | None = Field(description="The clique within the cluster; null with no "
                                  "cluster UUID")
    clique: str | None = Field(description="<cluster_uuid>.<clique_id> when the fabric is "
                               "usable (completed, NVML_SUCCESS, a cluster UUID); else null")
    health_mask: int | None = Field(description="NVML's raw fabric health mask; null where "
                                    "the driver reports none")
    health: list[str] = Field(description="What the health mask flags: degraded_bandwidth, "
                              "route_recovery, route_unhealthy, access_timeout_recovery, "
                              "incorrect_configuration")

    @classmethod
    def of(cls, fabric: Fabric) -> FabricModel:
        zero = set(fabric.cluster_uuid) <= {"0", "-"}
        return cls(state=fabric.state_name, status=fabric.status_name,
                   cluster_uuid=None if zero else fabric.cluster_uuid,
                   clique_id=None if zero else fabric.clique_id, clique=fabric.clique,
                   health_mask=fabric.health_mask, health=list(fabric.health))


class TaintModel(BaseModel):
    """A device taint, as the ResourceSlices carry it (``agent/health/taints.py``), and why."""

    key: str = Field(description="<driver>/<kind>: xid, gpu-lost, unmonitored, quarantined, "
                                 "drain, fabric, fabric-health")
    value: str | None = Field(description="The XID for xid taints, the reason as a label value "
                                          "for drain, the fabric's state or status for fabric, "
                                          "the health flag for fabric-health; null otherwise")
    effect: Literal["None", "NoSchedule", "NoExecute"] = Field(
        description="None: informational, never blocks; NoSchedule: new claims stay off; "
                    "NoExecute (--no-execute-taints): Kubernetes also evicts the pods using it")
    time_added: str = Field(description="When the fault was first seen: RFC 3339, UTC, seconds "
                                        "(the slices' timeAdded)")
    reason: str = Field(description="Why, in words")

    @classmethod
    def of(cls, taint: Taint) -> TaintModel:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(taint.time_added))
        return cls(key=taint.key, value=taint.value, effect=taint.effect, time_added=stamp,
                   reason=taint.reason)


class AvailabilityModel(BaseModel):
    state: Literal["available", "held", "unavailable"] = Field(
        description="unavailable: lost, unhealthy, quarantined, drained or being created (the "
                    "reasons say which); held: claims hold it; available: a claim may take it")
    available: bool = Field(description="Whether a new claim may take it now")
    reasons: list[str] = Field(description="Why not, besides holders: the reasons of its "
                                           "blocking taints (lost, unhealthy: the XID, "
                                           "quarantined, drained by an operator), or being "
                                           "drained or created by a MIG transition")
    holders: list[str] = Field(description="Claims holding it (or, for a GPU, anything on it)")

    @classmethod
    def of(cls, availability: Availability) -> AvailabilityModel:
        state = "unavailable" if availability.reasons else \
            "held" if availability.holders else "available"
        return cls(state=state, available=availability.available,
                   reasons=list(availability.reasons), holders=list(availability.holders))


class HoldModel(BaseModel):
    claim: str
    state: Literal["reserved", "prepared", "releasing"] = Field(
        description="reserved: being prepared; prepared: durable; releasing: being unprepared")
    device: str = Field(description="'whole GPU' or the MIG memory slices start:size")
    profile: str | None
    on_demand: bool = Field(description="A slice made for the claim")
    kind: Literal["exclusive", "share", "admin"] = Field(
        description="exclusive; share: a counted part of its capacity; admin: a monitoring "
                    "tool's non-exclusive hold (DRA adminAccess), which takes the device from "
                    "nobody and blocks no geometry change")

    @classmethod
    def of(cls, hold: Hold) -> HoldModel:
        placement = hold.key.placement
        return cls(claim=hold.holder, state=hold.state, profile=hold.profile,
                   on_demand=hold.on_demand, kind=hold.kind,
                   device="whole GPU" if placement is None
                   else f"slices {placement.start}:{placement.size}")


class ShareHolderModel(BaseModel):
    claim: str
    memory_mib: int | None = Field(description="Its counted share; null: the whole GPU, "
                                   "under MPS")
    share_id: str | None
    used_mib: int | None = Field(description="Device memory its MPS clients use now (NVML "
                                 "MPS compute processes); null when not readable")
    mps_state: str | None = Field(description="Its MPS daemon: running or failed")


class GpuSharesModel(BaseModel):
    capacity_mib: int = Field(description="Shareable memory: the total in whole GiB")
    left_mib: int
    compute_mode: str | None = Field(default=None, description="DEFAULT (shares: several "
                                     "daemons) or EXCLUSIVE_PROCESS (one claim's daemon), as "
                                     "NVML reports it; null when unreadable")
    holders: list[ShareHolderModel]


class MigDeviceModel(BaseModel):
    index: int = Field(description="NVML MIG device index")
    uuid: str
    profile: str
    gi_id: int
    ci_id: int
    placement: PlacementModel
    memory_mib: int
    multiprocessors: int
    draining: bool
    availability: AvailabilityModel
    taints: list[TaintModel] = Field(default_factory=list, description="Its GPU's taints and "
                                     "its own instance's")

    @classmethod
    def of(cls, device: MigDevice, availability: Availability, *,
           draining: bool = False, taints: tuple[Taint, ...] = ()) -> MigDeviceModel:
        return cls(index=device.index, uuid=device.uuid, profile=device.profile,
                   gi_id=device.gi_id, ci_id=device.ci_id,
                   placement=PlacementModel(start=device.placement.start,
                                            size=device.placement.size),
                   memory_mib=device.memory_mib, multiprocessors=device.multiprocessors,
                   draining=draining, availability=AvailabilityModel.of(availability),
                   taints=[TaintModel.of(t) for t in taints])


class GpuModel(BaseModel):
    index: int
    minor: int
    uuid: str
    name: str
    brand: str
    architecture: str
    cuda_compute_capability: str
    pci_bus_id: str
    memory_total_mib: int
    numa_node: int | None
    cpu_affinity: str = Field(description="CPUs near this GPU, as a Linux cpulist")
    mig_capable: bool
    mig_mode: MigModeModel | None = Field(description="null where the GPU cannot do MIG")
    mig_devices: list[MigDeviceModel]
    health: HealthModel
    taints: list[TaintModel] = Field(default_factory=list, description="The GPU's device "
                                     "taints (its MIG devices carry them too); only blocking "
                                     "ones make it unavailable")
    drained: str | None = Field(default=None, description="Why an operator drained it (new "
                                "claims stay off, held ones stay), or null")
    availability: AvailabilityModel = Field(description="The whole GPU, from the ledger")
    holds: list[HoldModel] = Field(description="Every claim's hold on the GPU or a device "
                                               "on it, reservations included")
    transition: str | None = Field(description="The MIG transition owning the GPU, if any")
    shares: GpuSharesModel | None = Field(default=None, description="The claims sharing the "
                                          "GPU (MPS, memory shares) and what is left")
    fabric: FabricModel | None = Field(default=None, description="Multi-node NVLink: null "
                                       "where the GPU has no fabric (NVML NOT_SUPPORTED)")
    domain: str | None = Field(default=None, description="The compute domain (GET "
                               "/v1/domains) the GPU's node is a member of, for a GPU with an "
                               "NVLink fabric; null otherwise")

    @classmethod
    def of(cls, gpu: Gpu, ledger: NodeLedger, *, domain: str | None = None) -> GpuModel:
        s = gpu.static
        # Health: what is wrong with the GPU (an operator's drain is not).
        unhealthy = list(dict.fromkeys(t.reason for t in ledger.taints(gpu)
                                       if t.blocking and not t.key.endswith("/drain")))
        draining = ledger.draining(gpu.uuid)
        return cls(
            index=s.index, minor=s.minor, uuid=s.uuid, name=s.name, brand=s.brand,
            architecture=s.architecture, cuda_compute_capability=s.cuda_compute_capability,
            pci_bus_id=s.pci_bus_id, memory_total_mib=s.memory_total_mib, numa_node=s.numa_node,
            cpu_affinity=s.cpu_affinity, mig_capable=s.mig_capable,
            mig_mode=MigModeModel(current=gpu.mig_mode.current, pending=gpu.mig_mode.pending)
            if gpu.mig_mode else None,
            mig_devices=[MigDeviceModel.of(d, ledger.availability(gpu, d),
                                           draining=d.placement in draining,
                                           taints=ledger.taints(gpu, d))
                         for d in gpu.mig_devices],
            health=HealthModel(healthy=not unhealthy, reasons=unhealthy),
            taints=[TaintModel.of(t) for t in ledger.taints(gpu)],
            drained=ledger.drained(gpu.uuid),
            availability=AvailabilityModel.of(ledger.availability(gpu)),
            holds=[HoldModel.of(h) for h in ledger.holds(gpu.uuid)],
            transition=ledger.busy(gpu.uuid),
            fabric=FabricModel.of(gpu.fabric) if gpu.fabric else None,
            domain=domain if gpu.fabric else None,
        )


class GpuList(BaseModel):
    gpus: list[GpuModel]


class ImexModel(BaseModel):
    address: str = Field(description="This node's IMEX address (--imex-address)")
    port: int = Field(description="The IMEX peer port (--imex-port)")


class NodeModel(BaseModel):
    hostname: str
    driver_version: str
    cuda_driver_version: str
    nvml_version: str
    boot_id: str
    backend: str = Field(description="'nvml' on a real node, 'simulated:<preset>' otherwise")
    agent_version: str
    gpu_count: int
    imex: ImexModel | None = Field(default=None, description="Compute domains: this node's "
                                   "IMEX address and port; null without --imex-address")

    @classmethod
    def of(cls, *, hostname: str, driver: DriverInfo, boot_id: str, backend: str,
           agent_version: str, gpu_count: int, imex: ImexModel | None = None) -> NodeModel:
        return cls(hostname=hostname, driver_version=driver.driver_version,
                   cuda_driver_version=driver.cuda_driver_version,
                   nvml_version=driver.nvml_version, boot_id=boot_id, backend=backend,
                   agent_version=agent_version, gpu_count=gpu_count, imex=imex)


class EventModel(BaseModel):
    seq: int
    epoch: str = Field(description="The agent start that recorded it")
    time: str = Field(description="UTC, ISO 8601 with milliseconds (as in the logs)")
    kind: str
    severity: Literal["info", "warning", "error"]
    gpu: str | None
    message: str
    details: dict[str, Any]

    @classmethod
    def of(cls, event: Event) -> EventModel:
        return cls(seq=event.seq, epoch=event.epoch, time=iso_time(event.time),
                   kind=event.kind, severity=event.severity.value, gpu=event.gpu,
                   message=event.message, details=dict(event.details))


class EventList(BaseModel):
    epoch: str = Field(description="This start of the agent; it changes on every restart. "
                                   "Pass it back as ?epoch= with ?since=")
    last_seq: int = Field(description="Pass as ?since= (with ?epoch=) to get only newer "
                                      "events")
    reset: bool = Field(description="The cursor given did not belong to this history (a "
                                    "since beyond the newest event, or an epoch no longer "
                                    "kept): events is everything retained, and the client "
                                    "may have missed some")
    events: list[EventModel]


# -- simulation controls (only with --simulate) --------------------------------------------


class SimProcessRequest(Strict):
    device: str = Field(description="GPU or MIG device: UUID, GPU index or <gpu>:<mig>",
                        min_length=1, max_length=96)
    pid: int | None = Field(default=None, ge=1, le=4_194_304)
    used_memory_mib: int | None = Field(default=None, ge=0, le=1 << 24)
    mps_pipe_directory: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="Make it an MPS client of the control daemon serving this pipe directory "
                    "(CUDA_MPS_PIPE_DIRECTORY): held to the daemon's pinned memory limit")
    uid: int = Field(default=0, ge=0, le=(1 << 32) - 2,
                     description="The client's user ID (MPS runs one user's server at a time)")


class SimProcess(BaseModel):
    model_config = ConfigDict(extra="allow")
    pid: int
    device: str
    used_memory_mib: int
    mps: dict[str, Any] | None = Field(
        default=None, description="For an MPS client: its server, uid, daemon, pipe "
        "directory, active thread percentage and pinned limit (MiB) on its device")


class SimFaultRequest(Strict):
    function: str = Field(min_length=4, max_length=128,
                          description="NVML function name, e.g. nvmlDeviceCreateGpuInstance"
                                      "WithPlacement, or a driver tool: nvidia-smi (its next "
                                      "call fails), nvidia-cuda-mps-control (its next -d "
                                      "start fails), nvidia-imex (its next start fails)")
    error: str = Field(min_length=1, max_length=200,
                       description="NVML_ERROR_* name, or CRASH to SIGKILL the agent at the "
                                   "call; for a tool, the message it fails with")
    gpu: str | None = Field(default=None, max_length=96)
    skip: int = Field(default=0, ge=0, le=1_000_000)
    times: int = Field(default=1, ge=1, le=1_000_000)


class SimFault(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: str
    error: str


class SimXidRequest(Strict):
    gpu: str = Field(min_length=1, max_length=96,
                     description="GPU or MIG device: UUID, GPU index or <gpu>:<mig>")
    xid: int = Field(ge=1, le=1_000_000)
    recovery_action: Literal["none", "reset", "reboot", "drain-p2p", "drain-and-reset"] | None \
        = Field(default=None, description="the GPU's NVML recovery action after the XID "
                "(default: what the simulated driver sets for this XID; a preset whose "
                "driver reports none refuses it)")


class SimFabricRequest(Strict):
    gpu: str = Field(min_length=1, max_length=96, description="GPU UUID or index")
    condition: Literal["completed", "not-started", "in-progress", "failed", "degraded"] = Field(
        description="what the GPU's fabric reports from now on: completed (healthy), "
        "not-started / in-progress (registration not done: no cluster, no clique), failed "
        "(completed with an error status), degraded (completed, degraded bandwidth in the "
        "health mask)")
    status: str | None = Field(default=None, max_length=64, description="failed only: the "
                               "NVML error it reports (default NVML_ERROR_INSUFFICIENT_RESOURCES)")


class SimState(BaseModel):
    model_config = ConfigDict(extra="allow")
    preset: str
    presets: list[str]
    processes: list[dict[str, Any]]
    mps_daemons: list[dict[str, Any]] = Field(
        default_factory=list, description="MPS control daemons the simulated driver knows: "
        "pid, pipe directory, devices, defaults, servers and their clients")
    faults: list[dict[str, Any]]
    latencies: dict[str, float]
    calls: dict[str, int]


class SimLatencyRequest(RootModel[dict[str, Annotated[float, Field(ge=0, le=30)]]]):
    """Seconds added to every call of each named NVML function; replaces the whole table."""


class SimGpuRequest(Strict):
    gpu: str = Field(min_length=1, max_length=96, description="GPU UUID or index")
