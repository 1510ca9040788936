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
    gpus = await ctx.node.inventory.refresh()
    return json_response(GpuList(gpus=[_model(ctx, g) for g in gpus]))


async def get_gpu(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.node.inventory.refresh()
    return json_response(_model(ctx, ctx.node.inventory.find(request.match_info["gpu"])))


def _model(ctx: AgentContext, gpu: Gpu) -> GpuModel:
    """The inventory with what the ledger adds: availability, holders, drain marks."""
    return GpuModel.of(gpu, ctx.node.ledger)
