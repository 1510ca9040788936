"""GPU inventory endpoints."""

from __future__ import annotations

from aiohttp import web

from agent.api.context import AGENT
from agent.api.models import GpuList, GpuModel
from agent.api.node import require_ready
from agent.api.routing import json_response


async def list_gpus(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    gpus = await ctx.inventory.refresh()
    return json_response(GpuList(gpus=[GpuModel.of(g) for g in gpus]))


async def get_gpu(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    await ctx.inventory.refresh()
    return json_response(GpuModel.of(ctx.inventory.find(request.match_info["gpu"])))
