"""GPU inventory endpoints."""

from __future__ import annotations

from aiohttp import web

from agent.api.context import AGENT, AgentContext
from agent.api.models import GpuList, GpuModel
from agent.api.node import require_ready
from agent.api.routing import json_response
from agent.gpu.types import Gpu


async def list_gpus(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    gpus = await ctx.inventory.refresh()
    return json_response(GpuList(gpus=[_model(ctx, g) for g in gpus]))


async def get_gpu(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.inventory.refresh()
    return json_response(_model(ctx, ctx.inventory.find(request.match_info["gpu"])))


def _model(ctx: AgentContext, gpu: Gpu) -> GpuModel:
    """The inventory with what the agent adds: drain marks, quarantine and XID marks."""
    xids = ctx.health.xid_reasons(gpu.uuid) if ctx.health is not None else ()
    if ctx.mig is None:
        return GpuModel.of(gpu, reasons=xids)
    quarantined = ctx.mig.quarantined(gpu.uuid)
    return GpuModel.of(gpu, draining=ctx.mig.draining(gpu.uuid),
                       reasons=((f"quarantined: {quarantined}",) if quarantined else ()) + xids)
