"""Probes, node identity, events, metrics and the OpenAPI document."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from aiohttp import web

import agent
from agent.api.context import AGENT, AgentContext
from agent.api.models import EventList, EventModel, ImexModel, NodeModel, Status
from agent.api.routing import json_response
from agent.device_names import ascii_integer
from agent.errors import InvalidRequest, NotReady
from agent.host import boot_id
from agent.metrics import exposition

OpenApiDocument = Callable[[], dict[str, Any]]
OPENAPI: web.AppKey[OpenApiDocument] = web.AppKey("openapi")


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
    settings = ctx.node.settings
    return json_response(NodeModel.of(
        hostname=settings.node_name, driver=ctx.node.inventory.driver,
        boot_id=boot_id(settings.proc_root), backend=ctx.node.backend.name,
        agent_version=agent.__version__, gpu_count=len(ctx.node.inventory.gpus),
        imex=ImexModel(address=settings.imex_address, port=settings.imex_port)
        if settings.imex_address is not None else None))


_EPOCH = re.compile(r"^[0-9a-f]{16}\Z")


async def list_events(request: web.Request) -> web.Response:
    """Events after the cursor ``(?epoch=, ?since=)``; a cursor from before a restart reads
    on from where it stopped while the history still holds it, and is answered
    ``reset: true`` (everything retained) when it does not."""
    raw = request.query.get("since", "0")
    since = ascii_integer(raw)
    if since is None:
        raise InvalidRequest(f"since: {raw[:40]!r} is not a non-negative integer",
                             [{"field": "since", "reason": "not a non-negative integer"}])
    epoch = request.query.get("epoch")
    if epoch is not None and not _EPOCH.match(epoch):
        raise InvalidRequest(f"epoch: {epoch[:40]!r} is not an epoch (16 hex digits, as "
                             "/v1/events answers it)",
                             [{"field": "epoch", "reason": "not 16 lower-case hex digits"}])
    log = request.app[AGENT].node.events
    page = log.after(since, epoch)
    # last_seq is always the history's own: a cursor the agent never handed out (since=99999)
    # must not come back looking valid.
    last = page.events[-1].seq if page.events else log.last_seq
    return json_response(EventList(epoch=log.epoch, last_seq=last, reset=page.reset,
                                   events=[EventModel.of(e) for e in page.events]))


async def metrics(request: web.Request) -> web.Response:
    """The collector's last snapshot (never an NVML call) and the live gpu_agent_* registry."""
    ctx = request.app[AGENT]
    body, headers = exposition.scrape(ctx.node.collector.snapshot.block, ctx.node.metrics.registry,
                                      accept_encoding=request.headers.get("Accept-Encoding", ""))
    return web.Response(body=body, headers=headers)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI]())
