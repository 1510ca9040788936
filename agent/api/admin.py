"""Remediation for operators (``admin`` scope, audited like every mutation)."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from agent.api.body import parse_body
from agent.api.context import AGENT, PRINCIPAL, AgentContext
from agent.api.mig_models import TransitionModel
from agent.api.models import Strict, TaintModel
from agent.api.node import require_ready
from agent.api.routing import Route, json_response
from agent.claims.service import ClaimService
from agent.errors import Conflict, InvalidRequest
from agent.events import Severity
from agent.gpu.types import Gpu
from agent.mig.service import MigService


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuarantineCleared(BaseModel):
    gpu: str = Field(description="GPU UUID")
    index: int
    was: str = Field(description="Why it had been quarantined")


class HealthCleared(BaseModel):
    gpu: str = Field(description="GPU UUID")
    index: int
    cleared: list[str] = Field(description="The marks lifted: XIDs, and the GPU-lost mark")


class DrainRequest(Strict):
    reason: str = Field(min_length=1, max_length=256,
                        description="Why, for the cluster to see: the drain taint's value (as a "
                                    "label value) and its reason")


class Drained(BaseModel):
    gpu: str = Field(description="GPU UUID")
    index: int
    reason: str
    taint: TaintModel = Field(description="The NoSchedule taint its devices now carry")


class Undrained(BaseModel):
    gpu: str = Field(description="GPU UUID")
    index: int
    was: str = Field(description="Why it had been drained")


class CheckpointRequest(_Strict):
    action: Literal["restore", "accept-empty"] = Field(
        description="restore: put a kept-aside file back (it must pass its check); "
                    "accept-empty: start from an empty checkpoint (prepared claims are lost)")
    file: str | None = Field(default=None, description="Name of a file of the checkpoint "
                                                       "beside it: kept aside "
                                                       "(claims.checkpoint.corrupt-...) or "
                                                       "an operator's copy "
                                                       "(claims.checkpoint.backup)")


class CheckpointStatus(BaseModel):
    corrupt: str | None = Field(description="Why claims are frozen, or null")
    kept: list[str] = Field(description="Files of the checkpoint next to it (kept aside, or "
                                        "an operator's copies): what restore accepts")
    claims: int = Field(description="Claims in the checkpoint in use")
    ready: bool


class ResolveRequest(_Strict):
    action: Literal["roll-back", "finish"] = Field(
        description="roll-back: restore the recorded old geometry; finish: accept the target "
                    "(only when the hardware shows it)")


def _who(request: web.Request) -> str:
    return request[PRINCIPAL]


async def _gpu(request: web.Request) -> tuple[AgentContext, MigService, Gpu]:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.node.inventory.refresh()
    gpu = ctx.node.inventory.find(request.match_info["gpu"])
    return ctx, ctx.node.mig, gpu


async def clear_quarantine(request: web.Request) -> web.Response:
    _, service, gpu = await _gpu(request)
    was = await service.clear_quarantine(gpu, _who(request))
    return json_response(QuarantineCleared(gpu=gpu.uuid, index=gpu.index, was=was))


async def clear_health(request: web.Request) -> web.Response:
    """An operator's word that a GPU was reset behind the agent's back (``nvidia-smi -r`` by
    hand): its XID marks and lost mark are lifted. A GPU still lost is marked again at its
    next NVML answer, so this can hide nothing for long."""
    ctx = request.app[AGENT]
    require_ready(ctx)
    gpu = ctx.node.inventory.find(request.match_info["gpu"])
    lost = ctx.node.session.lost_reason(gpu.uuid)
    if lost is None and not any(f.kind in ("xid", "quarantined")
                                for f in ctx.node.health.faults(gpu.uuid)):
        raise Conflict(f"GPU {gpu.index} has no XID or lost mark to clear", gpu=gpu.uuid)
    ctx.node.session.clear_lost(gpu.uuid)
    cleared = ctx.node.health.clear(gpu.uuid, why=f"cleared by {_who(request)}")
    if lost is not None:
        cleared.insert(0, f"GPU is lost: {lost}")
        ctx.node.health.check()
    ctx.node.publish_availability()
    return json_response(HealthCleared(gpu=gpu.uuid, index=gpu.index, cleared=cleared))


def _drained(ctx: AgentContext, gpu: Gpu) -> Drained:
    taint = next(t for t in ctx.node.ledger.taints(gpu) if t.key.endswith("/drain"))
    return Drained(gpu=gpu.uuid, index=gpu.index, reason=ctx.node.ledger.drained(gpu.uuid) or "",
                   taint=TaintModel.of(taint))


async def drain_gpu(request: web.Request) -> web.Response:
    """An operator's drain: new claims stay off the GPU (its devices are published with a
    NoSchedule drain taint), claims it holds stay. Repeating it with the same reason is a
    no-op; another reason while drained is a conflict (undrain first)."""
    body = await parse_body(request, DrainRequest)
    ctx, _, gpu = await _gpu(request)
    ledger = ctx.node.ledger
    if not await ledger.drain(gpu.uuid, body.reason) and ledger.drained(gpu.uuid) != body.reason:
        raise Conflict(f"GPU {gpu.index} is drained already: {ledger.drained(gpu.uuid)} "
                       "(undrain it first to change the reason)", gpu=gpu.uuid)
    ctx.node.publish_availability()
    return json_response(_drained(ctx, gpu))


async def undrain_gpu(request: web.Request) -> web.Response:
    ctx, _, gpu = await _gpu(request)
    was = await ctx.node.ledger.undrain(gpu.uuid)
    ctx.node.publish_availability()
    return json_response(Undrained(gpu=gpu.uuid, index=gpu.index, was=was))


async def resolve_transition(request: web.Request) -> web.Response:
    body = await parse_body(request, ResolveRequest)
    _, service, gpu = await _gpu(request)
    transition = await service.resolve_by_hand(gpu, body.action, _who(request))
    return json_response(TransitionModel.of(transition))


def _claims(ctx: AgentContext) -> ClaimService:
    return ctx.node.claims


def _status(ctx: AgentContext) -> CheckpointStatus:
    claims = _claims(ctx)
    path = claims.checkpoint.path
    kept = sorted(p.name for p in path.parent.glob(f"{path.name}.*")
                  if ".tmp." not in p.name and p.is_file())
    return CheckpointStatus(corrupt=str(claims.corrupt) if claims.corrupt else None, kept=kept,
                            claims=len(claims.records()), ready=ctx.node.readiness.ready)


async def checkpoint_status(request: web.Request) -> web.Response:
    return json_response(_status(request.app[AGENT]))


async def remediate_checkpoint(request: web.Request) -> web.Response:
    body = await parse_body(request, CheckpointRequest)
    ctx = request.app[AGENT]
    require_ready(ctx)
    if body.action == "restore" and not body.file:
        raise InvalidRequest("restore needs the kept-aside file's name in 'file'",
                             [{"field": "file", "reason": "required for restore"}])
    claims = _claims(ctx)
    await claims.remediate_checkpoint(body.file if body.action == "restore" else None)
    # Start-up stopped short of ready only for the checkpoint; everything else is up.
    if claims.corrupt is None and not ctx.node.readiness.ready and ctx.node.inventory.loaded \
            and "checkpoint" in (ctx.node.readiness.reason or ""):
        ctx.node.readiness.set(None)
        ctx.node.metrics.ready.set(1)
        ctx.node.events.append("agent.ready", f"agent ready after the claims checkpoint was "
                               f"remediated by {_who(request)}", severity=Severity.INFO)
    return json_response(_status(ctx))


ROUTES = [
    Route("POST", "/v1/admin/gpus/{gpu}/clear-quarantine", clear_quarantine,
          "Remediation: lift a GPU's quarantine once its layout was restored by hand",
          QuarantineCleared, scope="admin", tag="admin", errors=(404, 409, 503)),
    Route("POST", "/v1/admin/gpus/{gpu}/clear-health", clear_health,
          "Remediation: lift a GPU's XID and lost marks after a reset the agent did not see",
          HealthCleared, scope="admin", tag="admin", errors=(404, 409, 503)),
    Route("POST", "/v1/admin/gpus/{gpu}/drain", drain_gpu,
          "Remediation: drain a GPU: new claims stay off (a NoSchedule drain taint on its "
          "devices, with the reason), claims it holds stay; durable",
          Drained, body=DrainRequest, scope="admin", tag="admin",
          errors=(404, 409, 422, 503)),
    Route("DELETE", "/v1/admin/gpus/{gpu}/drain", undrain_gpu,
          "Remediation: lift an operator's drain (409 when the GPU is not drained)",
          Undrained, scope="admin", tag="admin", errors=(404, 409, 503)),
    Route("POST", "/v1/admin/transitions/{gpu}/resolve", resolve_transition,
          "Remediation: resolve a GPU's open journal entry by hand (roll-back or finish)",
          TransitionModel, body=ResolveRequest, scope="admin", tag="admin",
          errors=(404, 409, 422, 503)),
    Route("GET", "/v1/admin/claims-checkpoint", checkpoint_status,
          "Remediation: is the claims checkpoint corrupt, and which files were kept aside",
          CheckpointStatus, tag="admin", errors=(503,)),
    Route("POST", "/v1/admin/claims-checkpoint", remediate_checkpoint,
          "Remediation: restore a kept-aside claims checkpoint or accept an empty one; "
          "claims reconcile and readiness recovers without a restart",
          CheckpointStatus, body=CheckpointRequest, scope="admin", tag="admin",
          errors=(404, 409, 422, 503)),
]
