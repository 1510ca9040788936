"""MIG endpoints: profiles, geometry, transitions, node-wide apply of a mig-parted config."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from aiohttp import web

from agent.api.body import parse_body
from agent.api.context import AGENT, AgentContext
from agent.api.mig_models import (
    ApplyModel,
    ApplyRequest,
    BlockerModel,
    ExportedConfig,
    MigChange,
    MigGeometryModel,
    MigRequest,
    PlanModel,
    ProfileList,
    ProfileModel,
    SkippedGpu,
    TransitionList,
    TransitionModel,
)
from agent.api.models import MigModeModel
from agent.api.node import require_ready
from agent.api.routing import json_response
from agent.errors import Conflict, InvalidRequest, NotFound
from agent.gpu.types import Gpu
from agent.mig.catalog import catalog_of
from agent.mig.geometry import Geometry
from agent.mig.parted_config import (
    GpuIdentity,
    Selection,
    check_profiles,
    parse_config,
    selection,
)
from agent.mig.parted_export import export_config as export_parted
from agent.mig.service import ApplyRecord, MigService
from agent.mig.transition import DrainPolicy


async def _gpu(request: web.Request) -> tuple[AgentContext, MigService, Gpu]:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.node.inventory.refresh()
    gpu = ctx.node.inventory.find(request.match_info["gpu"])
    if not gpu.static.mig_capable:
        raise Conflict(f"GPU {gpu.index} ({gpu.static.name}) does not support MIG",
                       gpu=gpu.uuid)
    return ctx, ctx.node.mig, gpu


def _flag(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name}: {raw!r} is not true or false",
                             [{"field": name, "reason": "not a boolean"}])
    return raw in ("true", "1")


async def get_profiles(request: web.Request) -> web.Response:
    _, service, gpu = await _gpu(request)
    geometry, _ = await service.current(gpu)
    free = Geometry(mig_enabled=True, instances=geometry.instances).remaining_capacity(
        catalog_of(gpu.profiles))
    return json_response(ProfileList(gpu=gpu.uuid, profiles=[
        ProfileModel.of(p, free.get(p.name, 0)) for p in gpu.profiles]))


async def get_geometry(request: web.Request) -> web.Response:
    _, service, gpu = await _gpu(request)
    geometry, _ = await service.current(gpu)
    record = service.desired.get(gpu.uuid)
    active = service.active(gpu.uuid)
    mode = gpu.mig_mode
    return json_response(MigGeometryModel.of(
        gpu=gpu.uuid, index=gpu.index,
        mode=MigModeModel(current=mode.current, pending=mode.pending) if mode else None,
        geometry=geometry, draining=service.draining(gpu.uuid),
        last=Geometry.from_dict(record["geometry"]) if record else None,
        drift=service.drift(gpu.uuid), quarantined=service.quarantined(gpu.uuid),
        active=active.id if active else None))


async def put_geometry(request: web.Request) -> web.Response:
    dry_run = _flag(request, "dry_run")
    body = await parse_body(request, MigRequest)
    _, service, gpu = await _gpu(request)
    outcome = await service.request(gpu, body.desired(), body.drain.policy_value(),
                                    explicit_mode=body.mig_enabled is not None,
                                    allow_reset=body.allow_reset, dry_run=dry_run)
    answer = MigChange(
        dry_run=dry_run, plan=PlanModel.of(outcome.plan),
        blockers=[BlockerModel(instance=b.instance, kind=b.kind, id=b.id)
                  for b in outcome.blockers],
        transition=TransitionModel.of(outcome.transition) if outcome.transition else None)
    if outcome.transition is None:
        return json_response(answer)
    return json_response(answer, status=202,
                         headers={"Location": f"/v1/transitions/{outcome.transition.id}"})


def _service(request: web.Request) -> MigService:
    ctx = request.app[AGENT]
    require_ready(ctx)
    return ctx.node.mig


async def list_transitions(request: web.Request) -> web.Response:
    return json_response(TransitionList(transitions=[
        TransitionModel.of(t) for t in _service(request).transitions()]))


async def get_transition(request: web.Request) -> web.Response:
    return json_response(TransitionModel.of(
        _service(request).transition(request.match_info["id"])))


async def cancel_transition(request: web.Request) -> web.Response:
    transition = await _service(request).cancel(request.match_info["id"])
    return json_response(TransitionModel.of(transition))


@dataclass
class LabelApply(ApplyRecord):
    """An apply with what mig-parted's rules left out: GPUs without MIG skipped, indices the
    node lacks."""

    skipped: list[SkippedGpu] = field(default_factory=list)
    missing: tuple[int, ...] = ()


def _skipped(chosen: Selection, by_index: dict[int, Gpu]) -> list[SkippedGpu]:
    return [SkippedGpu(gpu=by_index[i].uuid, index=i,
                       reason=f"{by_index[i].static.name}: {why}")
            for i, why in chosen.skipped.items()]


async def apply_config(request: web.Request) -> web.Response:
    dry_run = _flag(request, "dry_run")
    body = await parse_body(request, ApplyRequest)
    ctx = request.app[AGENT]
    service = _service(request)
    gpus = await ctx.node.inventory.refresh()
    config = parse_config(body.config)
    chosen = selection(config, body.label, [
        GpuIdentity(g.index, g.static.pci_device_id, g.static.pci_subsystem_id,
                    mig_capable=g.static.mig_capable) for g in gpus])
    by_index = {g.index: g for g in gpus}
    check_profiles(chosen.desired, {i: catalog_of(by_index[i].profiles) for i in chosen.desired})
    skipped = _skipped(chosen, by_index)
    drain = body.drain.policy_value()
    # Every GPU is planned (and refused on a bad geometry or a blocker) before any changes,
    # so a bad config changes nothing; then each GPU succeeds or rolls back on its own.
    plans = []
    for index, desired in chosen.desired.items():
        gpu = by_index[index]
        outcome = await service.request(gpu, desired, drain, explicit_mode=True, dry_run=True)
        if outcome.blockers and drain.policy == "fail" and not dry_run:
            raise Conflict(f"GPU {index}: instances the plan destroys are in use: "
                           + ", ".join(f"{b.instance} by {b.kind} {b.id}"
                                       for b in outcome.blockers),
                           blockers=[b.__dict__ for b in outcome.blockers])
        plans.append((gpu.uuid, index, outcome.plan, outcome.blockers))
    if dry_run:
        return json_response(ApplyModel.planned(body.label, plans, skipped=skipped,
                                                missing=chosen.missing))
    record = LabelApply(id=uuid.uuid4().hex[:12], label=body.label, gpus=[], skipped=skipped,
                        missing=chosen.missing)
    for index, desired in chosen.desired.items():
        gpu = by_index[index]
        outcome = await service.request(gpu, desired, DrainPolicy(drain.policy, drain.timeout_s),
                                        explicit_mode=True, allow_reset=body.allow_reset,
                                        apply_id=record.id)
        record.gpus.append((gpu.uuid, index, outcome.transition.id
                            if outcome.transition else None))
    service.remember_apply(record)
    return json_response(_apply_model(service, record), status=202,
                         headers={"Location": f"/v1/mig/apply/{record.id}"})


def _apply_model(service: MigService, record: ApplyRecord) -> ApplyModel:
    transitions = {tid: service.transition(tid) for _, _, tid in record.gpus if tid is not None}
    if isinstance(record, LabelApply):
        return ApplyModel.of(record, transitions, skipped=record.skipped,
                             missing=record.missing)
    return ApplyModel.of(record, transitions)


async def get_apply(request: web.Request) -> web.Response:
    service = _service(request)
    apply_id = request.match_info["apply_id"]
    record = service.applies.get(apply_id)
    if record is None:
        raise NotFound(f"no apply {apply_id!r}")
    return json_response(_apply_model(service, record))


async def export_config(request: web.Request) -> web.Response:
    """The node's current layout as a mig-parted config: every GPU, from a fresh walk; a GPU
    without MIG as ``mig-enabled: false``, as ``nvidia-mig-parted export`` writes it."""
    ctx = request.app[AGENT]
    service = _service(request)
    layouts: dict[int, Geometry] = {}
    for gpu in await ctx.node.inventory.refresh():
        if gpu.static.mig_capable:
            layouts[gpu.index] = (await service.current(gpu))[0]
        else:
            layouts[gpu.index] = Geometry(mig_enabled=False)
    return json_response(ExportedConfig.model_validate(export_parted(layouts)))
