"""GPU inventory endpoints."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from agent.api.context import AGENT, AgentContext
from agent.api.models import GpuList, GpuModel, GpuSharesModel, ShareHolderModel
from agent.api.node import require_ready
from agent.api.routing import json_response
from agent.errors import AgentError
from agent.gpu.nvidia_smi import compute_mode
from agent.gpu.types import Gpu


async def list_gpus(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    gpus = await ctx.node.inventory.refresh()
    return json_response(GpuList(gpus=[await _model(ctx, g) for g in gpus]))


async def get_gpu(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.node.inventory.refresh()
    return json_response(await _model(ctx, ctx.node.inventory.find(request.match_info["gpu"])))


async def _model(ctx: AgentContext, gpu: Gpu) -> GpuModel:
    """The inventory with what the ledger adds (availability, holders, drain marks) and who
    shares the GPU."""
    member = ctx.node.domains.domain
    model = GpuModel.of(gpu, ctx.node.ledger, domain=member.id if member else None)
    shares = await ctx.node.claims.shares_of(gpu)
    if shares is None:
        return model
    session = ctx.node.session
    try:
        # One NVML read, for shared GPUs only: whether MPS runs it exclusively or shared.
        mode: str | None = await session.read(partial(compute_mode, session, gpu.uuid))
    except AgentError:
        mode = None
    return model.model_copy(update={"shares": GpuSharesModel(
        capacity_mib=shares.capacity_mib, left_mib=shares.left_mib, compute_mode=mode,
        holders=[ShareHolderModel(claim=h.claim, memory_mib=h.memory_mib, share_id=h.share_id,
                                  used_mib=h.used_mib, mps_state=h.mps_state)
                 for h in shares.holders])})
