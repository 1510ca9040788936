"""Probes, node identity, events, metrics and the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

import agent
from agent.api.context import AGENT, AgentContext
from agent.api.models import EventList, EventModel, NodeModel, Status
from agent.api.routing import json_response
from agent.device_names import ascii_integer
from agent.errors import InvalidRequest, NotReady
from agent.host import boot_id
from agent.metrics import exposition

OPENAPI = web.AppKey("openapi", dict)


def require_ready(ctx: AgentContext) -> None:
    """Raise :class:`NotReady` with the reason while NVML or the inventory is not up."""
    if not ctx.node.inventory.loaded:
        raise NotReady(f"agent not ready: {ctx.node.readiness.reason or 'inventory not loaded'}")


async def healthz(request: web.Request) -> web.Response:
    return json_response(Status(status="ok"))


async def readyz(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    readiness = ctx.node.readiness
    if readiness.ready:
        stale = ctx.node.collector.stale_reason()
        if stale is None:
            return json_response(Status(status="ready"))
        return json_response(Status(status="not ready", reason=stale), status=503)
    return json_response(Status(status="not ready", reason=readiness.reason), status=503)


async def get_node(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    return json_response(NodeModel.of(
        hostname=ctx.node.settings.node_name, driver=ctx.node.inventory.driver,
        boot_id=boot_id(ctx.node.settings.proc_root), backend=ctx.node.backend.name,
        agent_version=agent.__version__, gpu_count=len(ctx.node.inventory.gpus)))


async def list_events(request: web.Request) -> web.Response:
    raw = request.query.get("since", "0")
    since = ascii_integer(raw)
    if since is None:
        raise InvalidRequest(f"since: {raw[:40]!r} is not a non-negative integer",
                             [{"field": "since", "reason": "not a non-negative integer"}])
    events = request.app[AGENT].node.events.since(since)
    last = events[-1].seq if events else since
    return json_response(EventList(events=[EventModel.of(e) for e in events], last_seq=last))


async def metrics(request: web.Request) -> web.Response:
    """The collector's last snapshot (never an NVML call) and the live gpu_agent_* registry."""
    ctx = request.app[AGENT]
    body, headers = exposition.scrape(ctx.node.collector.snapshot.block, ctx.node.metrics.registry,
                                      accept_encoding=request.headers.get("Accept-Encoding", ""))
    return web.Response(body=body, headers=headers)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
