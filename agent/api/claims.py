"""Claims endpoints (prepare/unprepare/list) and the CDI specs the agent maintains."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from agent.api.body import parse_body
from agent.api.context import AGENT
from agent.api.models import PlacementModel, Strict
from agent.api.node import require_ready
from agent.api.routing import json_response, path_token
from agent.claims.checkpoint import (
    ClaimRecord,
    ImexChannelRecord,
    MpsDaemonRecord,
    PreparedDevice,
)
from agent.claims.requests import DeviceRequest
from agent.claims.service import ClaimService
from agent.claims.sharing import MpsConfig, SharingConfig, pinned_limit_mib
from agent.device_names import ascii_integer, parse_device_name, quantity_mib
from agent.errors import InvalidRequest


class PlacementStart(Strict):
    start: int = Field(ge=0, le=7)


def _mib(value: object) -> int:
    return quantity_mib(value)


#: A memory quantity in, whole MiB (rounded up) out: integer bytes or a Kubernetes quantity
#: string (``10Gi``, ``512Mi``).
Quantity = Annotated[int, BeforeValidator(_mib), WithJsonSchema({
    "oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "examples": ["10Gi"]}],
    "description": "A memory quantity: integer bytes or a Kubernetes quantity ('10Gi')"})]


#: An MPS pinned limit: whole MiB as NVIDIA's driver computes it (rounded down, at least 1).
PinnedLimit = Annotated[int, BeforeValidator(pinned_limit_mib), WithJsonSchema({
    "oneOf": [{"type": "integer", "minimum": 1048576}, {"type": "string", "examples": ["10Gi"]}],
    "description": "A memory quantity (integer bytes or a Kubernetes quantity, '10Gi'), "
    "applied in whole MiB rounded down as NVIDIA's driver does; below 1 MiB is refused"})]


class TimeSlicingConfigIn(Strict):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


class MpsConfigIn(Strict):
    """NVIDIA's ``mpsConfig``, its field names as NVIDIA spells them."""

    default_active_thread_percentage: int | None = Field(
        default=None, ge=1, le=100, alias="defaultActiveThreadPercentage")
    default_pinned_device_memory_limit: PinnedLimit | None = Field(
        default=None, alias="defaultPinnedDeviceMemoryLimit")
    default_per_device_pinned_memory_limit: dict[
        Annotated[str, Field(min_length=1, max_length=96)], PinnedLimit] | None = Field(
        default=None, max_length=16, alias="defaultPerDevicePinnedMemoryLimit",
        description="Per device (a UUID, or an index into the sorted UUIDs of the devices "
        "this config applies to): overrides the default limit")


class SharingIn(Strict):
    """NVIDIA's ``sharing`` (GpuConfig / MigDeviceConfig), strict."""

    strategy: Literal["TimeSlicing", "MPS"]
    time_slicing_config: TimeSlicingConfigIn | None = Field(default=None,
                                                             alias="timeSlicingConfig")
    mps_config: MpsConfigIn | None = Field(default=None, alias="mpsConfig")

    @model_validator(mode="after")
    def _one_config(self) -> SharingIn:
        if self.strategy == "TimeSlicing" and self.mps_config is not None:
            raise ValueError("mpsConfig is for strategy MPS, not TimeSlicing")
        if self.strategy == "MPS" and self.time_slicing_config is not None:
            raise ValueError("timeSlicingConfig is for strategy TimeSlicing, not MPS")
        return self

    def value(self) -> SharingConfig:
        mps = self.mps_config
        return SharingConfig(
            strategy=self.strategy,
            interval=(self.time_slicing_config.interval if self.time_slicing_config
                      else "Default") if self.strategy == "TimeSlicing" else None,
            mps=MpsConfig(
                thread_percentage=mps.default_active_thread_percentage,
                pinned_mib=mps.default_pinned_device_memory_limit,
                per_device_mib=tuple(sorted(
                    (mps.default_per_device_pinned_memory_limit or {}).items())))
            if mps is not None else None)


class CapacityIn(Strict):
    """DRA consumable capacity: a counted share of a full GPU's memory."""

    memory: Quantity


#: The device field that names what kind of device is asked for, and its old spelling (it
#: clashed with DRA's request names, which are ``name`` here).
KIND_FIELD, OLD_KIND_FIELD = "kind", "request"


class DeviceRequestIn(Strict):
    """``{"kind": "gpu", "device": ...}`` for an existing GPU or MIG device;
    ``{"kind": "slice", "profile": ..., "gpu"?, "placement"?}`` or
    ``{"kind": "slice", "device": <dynamic device name>}`` for a slice made on demand.
    ``kind`` was called ``request`` before; the old spelling is still accepted (an entry
    giving both is refused, 422 naming ``request``).
    ``name`` is the DRA request name the result echoes (defaults to ``kind``).
    ``admin_access`` (DRA adminAccess, for monitoring tools; existing devices only): the
    device is held without taking it from its holder, and blocks no other claim and no
    geometry change."""

    kind: Literal["gpu", "slice", "imex-channel"] = Field(
        description="What is asked for: 'gpu' (an existing GPU or MIG device), 'slice' (a "
        "MIG slice made on demand) or 'imex-channel' (the IMEX channel of the compute domain "
        "named by 'domain'). Formerly 'request', still accepted alone.")
    request: Literal["gpu", "slice"] | None = Field(
        default=None, json_schema_extra={"deprecated": True},
        description="Deprecated spelling of 'kind' (accepted when 'kind' is absent; giving "
        "both is refused)")
    name: str | None = Field(default=None, max_length=63)
    device: str | None = Field(default=None, min_length=1, max_length=96)
    profile: str | None = Field(default=None, max_length=32)
    gpu: str | None = Field(default=None, max_length=96)
    placement: PlacementStart | None = None
    admin_access: bool = False
    sharing: SharingIn | None = Field(default=None, description="GPU sharing (NVIDIA's "
                                      "GpuConfig/MigDeviceConfig 'sharing' shape)")
    capacity: CapacityIn | None = Field(default=None, description="A counted share of a full "
                                        "GPU (DRA consumable capacity)")
    share_id: str | None = Field(default=None, min_length=1, max_length=64,
                                 description="The allocation result's shareID, echoed back")
    domain: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                               description="kind 'imex-channel': the compute domain (as PUT "
                               "to /v1/domains/{domain}) whose channel the claim holds")

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        # The old spelling alone becomes ``kind``; with both, ``request`` stays for its own
        # validator to refuse under its name.
        if isinstance(data, dict) and OLD_KIND_FIELD in data and KIND_FIELD not in data:
            data = {KIND_FIELD if key == OLD_KIND_FIELD else key: value
                    for key, value in data.items()}
        return data

    @field_validator("request")
    @classmethod
    def _not_both(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("give 'kind' only: 'request' is its old spelling, and both were "
                             "given")
        return value

    @model_validator(mode="after")
    def _shape(self) -> DeviceRequestIn:
        if self.kind == "imex-channel":
            if self.domain is None:
                raise ValueError("kind 'imex-channel' names its compute domain in 'domain'")
            if self.device or self.profile or self.gpu or self.placement or \
                    self.admin_access or self.sharing or self.capacity or self.share_id:
                raise ValueError("kind 'imex-channel' gives a domain (and a name) only")
            return self
        if self.domain is not None:
            raise ValueError("domain is for kind 'imex-channel'")
        if self.admin_access and self.kind != "gpu":
            raise ValueError("admin_access is for existing devices (kind 'gpu'), not "
                             "slices made on demand")
        if self.kind == "gpu":
            if self.device is None or self.profile or self.gpu or self.placement:
                raise ValueError("kind 'gpu' names one existing device and nothing else")
        elif (self.device is None) == (self.profile is None):
            raise ValueError("kind 'slice' gives a profile or a device name, not both")
        elif self.device is not None and (self.gpu or self.placement):
            raise ValueError("a slice device name already fixes GPU and placement")
        if self.kind == "slice" and (self.sharing is not None or self.capacity is not None
                                     or self.share_id is not None):
            raise ValueError("sharing and capacity apply to existing devices (kind 'gpu'); "
                             "claim the MIG device once it exists to share it")
        return self

    def value(self) -> DeviceRequest:
        return DeviceRequest(
            request=self.name or self.kind, kind=self.kind, device=self.device,
            profile=self.profile, gpu=self.gpu,
            start=self.placement.start if self.placement else None,
            admin_access=self.admin_access,
            sharing=self.sharing.value() if self.sharing is not None else None,
            memory_mib=self.capacity.memory if self.capacity is not None else None,
            share_id=self.share_id, domain=self.domain)


class ClaimMetadata(Strict):
    namespace: str | None = Field(default=None, max_length=253)
    name: str | None = Field(default=None, max_length=253)
    pod: str | None = Field(default=None, max_length=253)
    container: str | None = Field(default=None, max_length=253)
    resource_version: str | None = Field(
        default=None, max_length=64, description="The ResourceClaim's metadata.resourceVersion "
        "the caller prepared from (kept and shown; it does not order requests)")


#: ``issued_at_ns``: a caller's ordering stamp (see docs/claims.md).
STAMP_DESCRIPTION = ("CLOCK_BOOTTIME nanoseconds of this node's boot at which the caller "
                     "received the request: orders prepares and unprepares of one claim UID")


class ClaimRequest(Strict):
    devices: list[DeviceRequestIn] = Field(min_length=1, max_length=16)
    metadata: ClaimMetadata | None = None
    issued_at_ns: int | None = Field(default=None, ge=0, description=STAMP_DESCRIPTION)
    device_names: Literal["any", "resourceslice"] = Field(
        default="any", description="'resourceslice': every device is named by its "
        "ResourceSlice device name (gpu-<minor>, gpu-<minor>-mig-<profile>-<id>-<start>), as "
        "the kubelet plugin passes an allocation; any other name is a 422 naming the entry, "
        "before anything is held, and the answer names each device as the request did")


class EffectiveSharingModel(BaseModel):
    strategy: Literal["TimeSlicing", "MPS"]
    interval: str | None = Field(description="TimeSlicing: the interval applied")
    thread_percentage: int | None = Field(description="MPS: the daemon's default active "
                                          "thread percentage (None: MPS's default, 100)")
    pinned_limit_mib: int | None = Field(description="MPS: the device's pinned memory limit "
                                         "per client process (None: no limit)")


class ShareModel(BaseModel):
    memory_mib: int
    share_id: str | None


class MpsDaemonModel(BaseModel):
    root: str
    pipe_directory: str
    devices: list[str]
    state: Literal["starting", "running", "failed"]
    reason: str | None

    @classmethod
    def of(cls, daemon: MpsDaemonRecord) -> MpsDaemonModel:
        return cls(root=daemon.root, pipe_directory=daemon.root + "/pipe",
                   devices=list(daemon.devices), state=daemon.state, reason=daemon.reason)


class MigInstanceModel(BaseModel):
    profile: str | None = Field(description="The MIG profile (1g.10gb); null only when the "
                                "GPU's profile table is not read yet")
    gi_id: int | None = Field(description="GPU instance ID (null until an on-demand slice "
                              "is made)")
    ci_id: int | None = Field(description="Compute instance ID")
    placement: PlacementModel


#: (GPU UUID, GI profile ID) -> profile name, from the inventory's last snapshot.
ProfileNames = Mapping[tuple[str, int], str]


def _mig_instance(device: PreparedDevice, profiles: ProfileNames) -> MigInstanceModel | None:
    """The MIG profile, instance IDs and placement of a prepared MIG device: an on-demand
    slice has them in its record, an existing device its placement there and its profile by
    the profile ID its name carries (``gpu-<minor>-mig-<profile>-<id>-<start>``)."""
    if device.kind != "mig":
        return None
    if device.slice is not None:
        made = device.slice
        return MigInstanceModel(profile=made.profile, gi_id=made.gi_id, ci_id=made.ci_id,
                                placement=PlacementModel(start=made.start, size=made.size))
    parsed = parse_device_name(device.device_name)
    if device.placement is None or parsed is None or parsed.profile_id is None:
        return None
    return MigInstanceModel(profile=profiles.get((device.gpu, parsed.profile_id)),
                            gi_id=device.gi_id, ci_id=device.ci_id,
                            placement=PlacementModel(start=device.placement[0],
                                                     size=device.placement[1]))


class PreparedDeviceModel(BaseModel):
    request: str
    kind: Literal["gpu", "mig", "imex-channel"]
    uuid: str | None
    parent_uuid: str | None
    pool: str
    device_name: str
    on_demand: bool = Field(description="A MIG slice made for this claim (destroyed at "
                                        "unprepare)")
    admin_access: bool = Field(description="Held for monitoring, non-exclusively")
    cdi_devices: list[str]
    sharing: EffectiveSharingModel | None = None
    share: ShareModel | None = None
    mig: MigInstanceModel | None = Field(default=None, description="A MIG device's profile, "
                                         "GPU/compute instance IDs and placement")
    domain: str | None = Field(default=None, description="An IMEX channel's compute domain")
    channel: int | None = Field(default=None, description="An IMEX channel's number")

    @classmethod
    def of_channel(cls, channel: ImexChannelRecord, pool: str) -> PreparedDeviceModel:
        return cls(request=channel.request, kind="imex-channel", uuid=None, parent_uuid=None,
                   pool=pool, device_name=channel.device_name, on_demand=False,
                   admin_access=False, cdi_devices=[channel.cdi_device],
                   domain=channel.domain, channel=channel.channel)

    @classmethod
    def of(cls, device: PreparedDevice, pool: str,
           profiles: ProfileNames | None = None) -> PreparedDeviceModel:
        sharing = device.sharing_state
        return cls(
            request=device.request, kind=device.kind, uuid=device.uuid,
            parent_uuid=device.gpu if device.kind == "mig" else None, pool=pool,
            device_name=device.device_name, on_demand=device.slice is not None,
            admin_access=device.admin_access, cdi_devices=[device.cdi_device],
            sharing=EffectiveSharingModel(
                strategy=sharing.strategy, interval=sharing.interval,
                thread_percentage=sharing.thread_percentage,
                pinned_limit_mib=sharing.pinned_mib) if sharing is not None else None,
            share=ShareModel(memory_mib=device.share.memory_mib,
                             share_id=device.share.share_id)
            if device.share is not None else None,
            mig=_mig_instance(device, profiles or {}))


class ClaimModel(BaseModel):
    uid: str
    state: Literal["prepare_started", "prepare_completed", "unprepare_started", "lost"]
    devices: list[PreparedDeviceModel]
    cdi_spec: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    lost_reason: str | None
    issued_at_ns: int | None = Field(description="The newest stamp of a prepare this claim "
                                     "answered (" + STAMP_DESCRIPTION + ")")
    mps: MpsDaemonModel | None = Field(default=None, description="The claim's MPS control "
                                       "daemon, when any device of it runs under MPS (the "
                                       "first, when it has several)")
    mps_daemons: list[MpsDaemonModel] = Field(
        default=[], description="Every MPS control daemon of the claim: one per MPS config")

    @classmethod
    def of(cls, record: ClaimRecord, pool: str,
           profiles: ProfileNames | None = None) -> ClaimModel:
        return cls(
            uid=record.uid, state=record.state, cdi_spec=record.cdi_spec,
            metadata=record.metadata, created_at=record.created_at,
            updated_at=record.updated_at, lost_reason=record.lost_reason,
            issued_at_ns=record.issued_at_ns,
            devices=[PreparedDeviceModel.of(d, pool, profiles) for d in record.devices] + (
                [PreparedDeviceModel.of_channel(record.imex, pool)] if record.imex else []),
            mps=MpsDaemonModel.of(record.mps) if record.mps is not None else None,
            mps_daemons=[MpsDaemonModel.of(d) for d in record.daemons()])


class ClaimList(BaseModel):
    claims: list[ClaimModel]


class CdiSpecModel(BaseModel):
    path: str
    kind: str
    cdi_version: str
    devices: list[str] = Field(description="Qualified device names")


class CdiList(BaseModel):
    spec_dir: str
    specs: list[CdiSpecModel]


def _profiles(request: web.Request) -> ProfileNames:
    """Each GPU's MIG profile names by GI profile ID, from the last inventory snapshot (no
    NVML call)."""
    return {(gpu.uuid, p.id): p.name for gpu in request.app[AGENT].node.inventory.gpus
            for p in gpu.profiles}


def _service(request: web.Request) -> ClaimService:
    ctx = request.app[AGENT]
    require_ready(ctx)
    return ctx.node.claims


def _uid(request: web.Request) -> str:
    return path_token(request, "uid", "a claim UID")


def _stamp(value: int | None, field: str) -> int | None:
    """A stamp from this boot's clock; one ahead of it cannot have been taken on this node in
    this boot (another host's or boot's clock) and would order nothing, so it is refused."""
    if value is not None and value > time.clock_gettime_ns(time.CLOCK_BOOTTIME):
        raise InvalidRequest(
            f"{field}: {value} is ahead of this node's CLOCK_BOOTTIME; stamp requests with "
            "time.clock_gettime_ns(time.CLOCK_BOOTTIME) on this node, in this boot",
            [{"field": field, "reason": "ahead of this node's boot clock"}])
    return value


async def prepare_claim(request: web.Request) -> web.Response:
    uid = _uid(request)
    body = await parse_body(request, ClaimRequest)
    stamp = _stamp(body.issued_at_ns, "issued_at_ns")
    service = _service(request)
    metadata = {k: v for k, v in (body.metadata.model_dump() if body.metadata else {}).items()
                if v is not None}
    record = await service.prepare(uid, [d.value() for d in body.devices], metadata,
                                   issued_at_ns=stamp, device_names=body.device_names)
    return json_response(ClaimModel.of(record, request.app[AGENT].node.settings.node_name,
                                       _profiles(request)))


async def unprepare_claim(request: web.Request) -> web.Response:
    uid = _uid(request)
    raw = request.query.get("issued_at_ns")
    stamp = None
    if raw is not None:
        stamp = ascii_integer(raw, digits=19)
        if stamp is None:
            raise InvalidRequest(f"issued_at_ns: {raw[:40]!r} is not a non-negative integer",
                                 [{"field": "issued_at_ns",
                                   "reason": "not a non-negative integer"}])
    await _service(request).unprepare(uid, issued_at_ns=_stamp(stamp, "issued_at_ns"))
    return web.Response(status=204)


async def list_claims(request: web.Request) -> web.Response:
    pool = request.app[AGENT].node.settings.node_name
    profiles = _profiles(request)
    return json_response(ClaimList(claims=[ClaimModel.of(r, pool, profiles)
                                           for r in _service(request).claims()]))


async def get_claim(request: web.Request) -> web.Response:
    record = _service(request).claim(_uid(request))
    return json_response(ClaimModel.of(record, request.app[AGENT].node.settings.node_name,
                                       _profiles(request)))


async def list_cdi(request: web.Request) -> web.Response:
    service = _service(request)
    specs = []
    for path in service.cdi.store.owned():
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        kind = str(doc.get("kind", ""))
        specs.append(CdiSpecModel(path=str(path), kind=kind,
                                  cdi_version=str(doc.get("cdiVersion", "")),
                                  devices=[f"{kind}={d.get('name')}"
                                           for d in doc.get("devices", [])]))
    return json_response(CdiList(spec_dir=str(service.cdi.store.directory), specs=specs))
