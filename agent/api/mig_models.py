"""Request and response models of the MIG endpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.api.models import MigModeModel, OneOf, PlacementModel, Strict
from agent.device_names import ascii_integer
from agent.gpu.types import GiProfile, Placement
from agent.mig.geometry import (
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    Plan,
)
from agent.mig.service import ApplyRecord
from agent.mig.transition import Blocker, DrainPolicy, Transition

PROFILE_NAME = r"^[0-9]+g\.[0-9]+gb(\+[a-z.]+)?$"


class PlacementIn(Strict):
    start: int = Field(ge=0, le=7, description="First memory slice")
    size: int = Field(ge=1, le=8, description="Number of memory slices")


class InstanceIn(Strict):
    profile: str = Field(pattern=PROFILE_NAME, max_length=32)
    placement: PlacementIn


class DrainIn(Strict):
    policy: Literal["fail", "wait"] = Field(
        default="fail", description="fail: 409 with the blockers at once; wait: up to timeout_s")
    timeout_s: float = Field(default=60.0, ge=0, le=3600)

    def policy_value(self) -> DrainPolicy:
        return DrainPolicy(self.policy, self.timeout_s)


class MigRequest(Strict):
    """Exactly one of: ``profiles`` (placed by the agent), ``instances`` (explicit placements),
    ``mig_enabled: false``; ``mig_enabled: true`` alone enables MIG with no instances."""

    profiles: list[str] | None = Field(default=None, max_length=7,
                                       description="Profile names, one per instance")
    instances: list[InstanceIn] | None = Field(default=None, max_length=7)
    mig_enabled: bool | None = Field(
        default=None, description="Required to change the MIG mode of pre-Hopper GPUs")
    drain: DrainIn = Field(default_factory=DrainIn)
    allow_reset: bool = Field(default=False, description="Let the agent run its configured "
                                                         "GPU reset command on an idle GPU")

    @model_validator(mode="after")
    def _one_form(self) -> MigRequest:
        if self.profiles is not None and self.instances is not None:
            raise ValueError("give either profiles or instances, not both")
        if self.mig_enabled is False and (self.profiles or self.instances):
            raise ValueError("mig_enabled false cannot have profiles or instances")
        if self.mig_enabled is None and self.profiles is None and self.instances is None:
            raise ValueError("give profiles, instances or mig_enabled")
        for name in self.profiles or ():
            if len(name) > 32 or ascii_integer(name[:1]) is None:
                raise ValueError(f"profiles: {name!r} is not a MIG profile name like 1g.10gb")
        return self

    def desired(self) -> Desired:
        if self.mig_enabled is False:
            return DesiredDisabled()
        if self.instances is not None:
            return DesiredInstances(tuple(
                (i.profile, Placement(i.placement.start, i.placement.size))
                for i in self.instances))
        return DesiredProfiles.of(self.profiles or ())


class InstanceModel(BaseModel):
    profile: str
    placement: PlacementModel
    gi_id: int | None
    held: bool = Field(description="A prepared claim or a running process uses it")

    @classmethod
    def of(cls, i: Instance) -> InstanceModel:
        return cls(profile=i.profile, placement=PlacementModel(start=i.placement.start,
                                                               size=i.placement.size),
                   gi_id=i.gi_id, held=i.held)


class PlanModel(BaseModel):
    summary: str
    mig_enabled_before: bool
    mig_enabled_after: bool
    keep: list[InstanceModel]
    destroy: list[InstanceModel]
    create: list[InstanceModel]

    @classmethod
    def of(cls, plan: Plan) -> PlanModel:
        return cls(summary=plan.summary(), mig_enabled_before=plan.mig_enabled_before,
                   mig_enabled_after=plan.mig_enabled_after,
                   keep=[InstanceModel.of(i) for i in plan.keep],
                   destroy=[InstanceModel.of(i) for i in plan.destroy],
                   create=[InstanceModel.of(i) for i in plan.create])


class StepModel(BaseModel):
    name: str
    started_at: float
    finished_at: float | None
    duration_s: float | None
    result: str | None
    error: str | None


class BlockerModel(BaseModel):
    instance: str
    kind: Literal["process", "claim"]
    id: str


class StateChange(BaseModel):
    state: str
    at: float


class TransitionModel(BaseModel):
    id: str
    gpu: str
    gpu_index: int
    state: Literal["requested", "planned", "draining", "applying", "verifying", "rolling_back",
                   "succeeded", "aborted", "rolled_back", "failed", "pending_reset"]
    terminal: bool
    requested: str
    plan: PlanModel
    drain: dict[str, Any]
    steps: list[StepModel]
    blockers: list[BlockerModel]
    error: str | None
    created_at: float
    finished_at: float | None
    duration_s: float | None
    apply_id: str | None
    history: list[StateChange]

    @classmethod
    def of(cls, t: Transition) -> TransitionModel:
        return cls(
            id=t.id, gpu=t.gpu, gpu_index=t.gpu_index, state=t.state.value,
            terminal=t.state.terminal, requested=t.requested, plan=PlanModel.of(t.plan),
            drain={"policy": t.drain.policy, "timeout_s": t.drain.timeout_s},
            steps=[StepModel(name=s.name, started_at=s.started_at, finished_at=s.finished_at,
                             duration_s=None if s.finished_at is None
                             else round(s.finished_at - s.started_at, 6),
                             result=s.result, error=s.error) for s in t.steps],
            blockers=[BlockerModel(instance=b.instance, kind=b.kind, id=b.id)
                      for b in t.blockers],
            error=t.error, created_at=t.created_at, finished_at=t.finished_at,
            duration_s=t.duration_s, apply_id=t.apply_id,
            history=[StateChange(state=s.value, at=at) for s, at in t.history])


class TransitionList(BaseModel):
    transitions: list[TransitionModel]


class MigChange(BaseModel):
    """The answer to PUT .../mig: the plan, and the transition running it (none when the
    geometry is already applied or for a dry run)."""

    dry_run: bool
    plan: PlanModel
    blockers: list[BlockerModel]
    transition: TransitionModel | None


class ComputeInstanceModel(BaseModel):
    id: int
    profile_id: int


class GpuInstanceModel(BaseModel):
    profile: str
    placement: PlacementModel
    gi_id: int | None
    held: bool
    draining: bool


class MigGeometryModel(BaseModel):
    gpu: str
    index: int
    mig_mode: MigModeModel | None
    instances: list[GpuInstanceModel]
    last_applied: list[str] | None = Field(
        description="Instances of the geometry last applied through the agent (null: none)")
    drift: str | None = Field(description="Why the hardware differs from the last applied "
                                          "geometry, when it does")
    quarantined: str | None
    active_transition: str | None

    @classmethod
    def of(cls, *, gpu: str, index: int, mode: MigModeModel | None, geometry: Geometry,
           draining: frozenset[Placement], last: Geometry | None, drift: str | None,
           quarantined: str | None, active: str | None) -> MigGeometryModel:
        return cls(
            gpu=gpu, index=index, mig_mode=mode,
            instances=[GpuInstanceModel(profile=i.profile, placement=PlacementModel(
                start=i.placement.start, size=i.placement.size), gi_id=i.gi_id, held=i.held,
                draining=i.placement in draining) for i in geometry.instances],
            last_applied=None if last is None else
            [str(i) for i in last.instances] if last.mig_enabled else [],
            drift=drift, quarantined=quarantined, active_transition=active)


class ProfileModel(BaseModel):
    name: str
    id: int = Field(description="Device profile ID (what nvidia-smi shows)")
    slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    max_instances: int
    placements: list[PlacementModel]
    free: int = Field(description="Instances of this profile that still fit now")

    @classmethod
    def of(cls, p: GiProfile, free: int) -> ProfileModel:
        return cls(name=p.name, id=p.id, slices=p.slices, memory_mib=p.memory_mib,
                   multiprocessors=p.multiprocessors, copy_engines=p.copy_engines,
                   decoders=p.decoders, encoders=p.encoders, jpeg_engines=p.jpeg_engines,
                   ofa_engines=p.ofa_engines, max_instances=p.max_instances,
                   placements=[PlacementModel(start=x.start, size=x.size) for x in p.placements],
                   free=free)


class ProfileList(BaseModel):
    gpu: str
    profiles: list[ProfileModel]


class ApplyRequest(Strict):
    config: Annotated[dict[str, Any] | str, OneOf(
        "a mig-parted v1 config: a JSON object or YAML text")] = Field(
        description="A mig-parted v1 config: a JSON object or YAML text")
    label: str = Field(min_length=1, max_length=128)
    drain: DrainIn = Field(default_factory=DrainIn)
    allow_reset: bool = Field(
        default=False, description="As in PUT /v1/gpus/{gpu}/mig: let the agent run its "
        "configured GPU reset command (--gpu-reset-command) on a GPU whose MIG mode change "
        "stays pending (Ampere), only when no process runs on it and no claim holds it")


class ApplyGpu(BaseModel):
    gpu: str
    index: int
    id: str | None = Field(description="Transition id; null when already applied, and for a "
                                       "dry run")
    state: str = Field(description="The transition's state; unchanged (already applied); "
                                   "planned (dry run)")
    plan: PlanModel | None = Field(description="What the apply does to this GPU (for a dry "
                                               "run, what it would do); null when unchanged")
    step: str | None = Field(description="The step running now, else the last one run")
    blockers: list[BlockerModel] = Field(
        description="What the drain waits for (for a dry run: what would block it now)")
    error: str | None


class SkippedGpu(BaseModel):
    gpu: str
    index: int
    reason: str


class ApplyModel(BaseModel):
    apply_id: str | None = Field(description="null for a dry run, which is not kept")
    label: str
    dry_run: bool
    state: Literal["planned", "running", "succeeded", "partial", "failed"] = Field(
        description="planned: a dry run; otherwise running until every GPU's transition ends")
    transitions: list[ApplyGpu] = Field(description="Every MIG-capable GPU the label selects")
    skipped: list[SkippedGpu] = Field(
        description="GPUs without MIG the label selects, left alone as mig-parted does "
                    "(under devices: all, or with mig-enabled: false)")
    missing_indices: list[int] = Field(
        description="GPU indices the label lists that this node lacks, ignored as mig-parted "
                    "does")

    @classmethod
    def of(cls, record: ApplyRecord, transitions: Mapping[str, Transition], *,
           skipped: Sequence[SkippedGpu] = (), missing: Sequence[int] = ()) -> ApplyModel:
        """A running or finished apply; ``transitions`` by id (a GPU without one was
        unchanged)."""
        rows = []
        for gpu, index, tid in record.gpus:
            t = transitions.get(tid or "")
            if t is None:
                rows.append(ApplyGpu(gpu=gpu, index=index, id=tid, state="unchanged",
                                     plan=None, step=None, blockers=[], error=None))
                continue
            step = t.steps[-1].name if t.steps else None
            rows.append(ApplyGpu(
                gpu=gpu, index=index, id=tid, state=t.state.value, plan=PlanModel.of(t.plan),
                step=step, blockers=[BlockerModel(instance=b.instance, kind=b.kind, id=b.id)
                                     for b in t.blockers], error=t.error))
        done = all(t.state.terminal for t in transitions.values())
        ok = [r.state in ("succeeded", "unchanged") for r in rows]
        overall: Literal["running", "succeeded", "partial", "failed"] = (
            "running" if not done else "succeeded" if all(ok) else
            "partial" if any(ok) else "failed")
        return cls(apply_id=record.id, label=record.label, dry_run=False, state=overall,
                   transitions=rows, skipped=list(skipped), missing_indices=list(missing))

    @classmethod
    def planned(cls, label: str, plans: Sequence[tuple[str, int, Plan, Sequence[Blocker]]], *,
                skipped: Sequence[SkippedGpu] = (), missing: Sequence[int] = ()) -> ApplyModel:
        """A dry run: each selected GPU's plan and what would block it now."""
        rows = [ApplyGpu(gpu=gpu, index=index, id=None,
                         state="unchanged" if plan.empty else "planned",
                         plan=PlanModel.of(plan), step=None,
                         blockers=[BlockerModel(instance=b.instance, kind=b.kind, id=b.id)
                                   for b in blockers], error=None)
                for gpu, index, plan, blockers in plans]
        return cls(apply_id=None, label=label, dry_run=True, state="planned", transitions=rows,
                   skipped=list(skipped), missing_indices=list(missing))


class ExportedConfig(BaseModel):
    """A mig-parted v1 config of the node's current layout, as ``nvidia-mig-parted export``
    prints it (every GPU, one without MIG as ``mig-enabled: false``)."""

    model_config = ConfigDict(serialize_by_alias=True, populate_by_name=True)

    version: Literal["v1"]
    mig_configs: dict[str, list[dict[str, Any]]] = Field(alias="mig-configs")
