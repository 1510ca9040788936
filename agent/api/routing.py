"""Routes as data: one table drives registration, authorisation and the OpenAPI document."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import BaseModel

from agent.api.context import AGENT, PRINCIPAL, REQUEST_ID
from agent.errors import Forbidden

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
access_log = logging.getLogger("agent.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class QueryParam:
    name: str
    schema: dict[str, object]
    description: str


@dataclass(frozen=True)
class Route:
    """One endpoint. ``scope`` marks a mutating endpoint and the token scope it needs;
    ``public`` endpoints (probes, metrics) never ask for a token."""

    method: str
    path: str
    handler: Handler
    summary: str
    response: type[BaseModel] | None
    body: type[BaseModel] | None = None
    status: int = 200
    scope: str | None = None
    public: bool = False
    tag: str = "node"
    query: tuple[QueryParam, ...] = ()
    errors: tuple[int, ...] = ()
    extra_responses: dict[int, type[BaseModel]] = field(default_factory=dict)
    content_type: str = "application/json"

    @property
    def mutating(self) -> bool:
        return self.method not in ("GET", "HEAD")


def json_response(model: BaseModel, *, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=model.model_dump_json(),
                        content_type="application/json", headers=headers)


def register(app: web.Application, routes: list[Route]) -> None:
    """Add every route, remembering its spec for the auth middleware and access log."""
    specs = route_specs(app)
    for spec in routes:
        route = app.router.add_route(spec.method, spec.path, spec.handler)
        specs[(spec.method, route.resource.canonical if route.resource else spec.path)] = spec


_SPECS = web.AppKey("route_specs", dict[tuple[str, str], Route])


def route_specs(app: web.Application) -> dict[tuple[str, str], Route]:
    if _SPECS not in app:
        app[_SPECS] = {}
    return app[_SPECS]


def _spec_of(request: web.Request) -> Route | None:
    resource = request.match_info.route.resource
    if resource is None:
        return None
    return request.app[_SPECS].get((request.method, resource.canonical))


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in and out, and one access-log line per request."""
    offered = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = offered if _REQUEST_ID.match(offered) else uuid.uuid4().hex
    request[PRINCIPAL] = "-"
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        response.headers["X-Request-Id"] = request[REQUEST_ID]
        return response
    finally:
        elapsed_ms = (time.perf_counter() - started) * 1000
        spec = _spec_of(request)
        route = spec.path if spec else "unmatched"
        request.app[AGENT].metrics.http_requests.labels(request.method, route, str(status)).inc()
        access_log.info("request", extra={
            "method": request.method, "path": request.path, "status": status,
            "duration_ms": round(elapsed_ms, 2), "request_id": request[REQUEST_ID],
            "peer": request.remote or "unix", "principal": request[PRINCIPAL]})


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Mutations need a token with the route's scope; ``/v1`` reads need one with --auth-read."""
    spec = _spec_of(request)
    ctx = request.app[AGENT]
    if spec is not None and not spec.public:
        needs_token = spec.mutating or ctx.settings.auth_read
        if needs_token:
            if not ctx.tokens.configured:
                raise Forbidden(
                    "mutating endpoints are disabled: no tokens are configured. Write lines "
                    "'name:token[:scope,...]' to a file readable only by the agent and start it "
                    "with --token-file FILE (or GPU_AGENT_TOKEN_FILE)")
            principal = ctx.tokens.authenticate(request.headers.get("Authorization"))
            request[PRINCIPAL] = principal.name
            principal.require(spec.scope or "read")
    return await handler(request)

