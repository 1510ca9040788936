"""Routes as data: one table drives registration, authorisation and the OpenAPI document."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from agent.api.access import UNPARSED, audit_log, peer_credentials, summarise_body
from agent.api.body import PARSED_BODY
from agent.api.context import AGENT, PRINCIPAL, REQUEST_ID
from agent.errors import BadRequest, Forbidden, InvalidRequest, NotReady, StorageUnavailable

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
access_log = logging.getLogger("agent.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
# Generated request ids: 32 hex digits, a random prefix per process and a counter (a uuid4 per
# request cost a getrandom call and 4% of the event loop under load).
_ID_PREFIX = secrets.token_hex(10)
_ID_COUNTER = itertools.count()
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


@dataclass(frozen=True)
class QueryParam:
    name: str
    schema: dict[str, object]
    description: str


@dataclass(frozen=True)
class Route:
    """One endpoint. ``scope`` marks a mutating endpoint and the token scope it needs;
    ``public`` endpoints (probes, metrics) never ask for a token; ``changes_nothing`` marks a
    POST that only computes an answer from its body (a query), authorised like a read;
    ``reconciled`` marks a read of state that start-up recovery reconciles (claims,
    geometry, transitions, slices), served only once recovery has finished, like every
    mutation."""

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
    changes_nothing: bool = False
    reconciled: bool = False
    #: Scopes that, besides ``read``, suffice for this read under --auth-read (the kubelet
    #: plugin holds a ``claims`` token only and reads its claims and the slices).
    read_by: tuple[str, ...] = ()
    #: Always authenticates the caller's token, even where reads need none (--auth-read off),
    #: and accepts any valid one whatever its scopes: a client checks its token with it.
    identifies: bool = False

    @property
    def mutating(self) -> bool:
        return self.method not in ("GET", "HEAD") and not self.changes_nothing

    @property
    def needs_recovery(self) -> bool:
        """Answered 503 until start-up recovery has finished. The simulator's controls change
        the fake hardware, not the agent's state, so tests can use them at any time."""
        return (self.mutating or self.reconciled) and self.tag != "simulation"


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
    if _COUNTED not in app:
        app[_COUNTED] = {}


_SPECS = web.AppKey("route_specs", dict[tuple[str, str], Route])
#: The request counter's children by (method, route, status): ``labels()`` validates and
#: locks on every call, and every request counts itself.
_COUNTED = web.AppKey("counted_requests", dict[tuple[str, str, int], Any])
#: The spec of the request's route, looked up once for the middlewares that all need it.
_ROUTE = web.RequestKey("route_spec", object)


def route_specs(app: web.Application) -> dict[tuple[str, str], Route]:
    if _SPECS not in app:
        app[_SPECS] = {}
    return app[_SPECS]


def _spec_of(request: web.Request) -> Route | None:
    known = request.get(_ROUTE)
    if isinstance(known, Route):
        return known
    resource = request.match_info.route.resource
    if resource is None:
        return None
    spec = request.app[_SPECS].get((request.method, resource.canonical))
    if spec is not None:
        request[_ROUTE] = spec
    return spec


def _count(request: web.Request, method: str, route: str, status: int) -> None:
    counted = request.app.get(_COUNTED)
    key = (method, route, status)
    child = counted.get(key) if counted is not None else None
    if child is None:
        child = request.app[AGENT].node.metrics.http_requests.labels(method, route,
                                                                      str(status))
        if counted is not None and len(counted) < _MAX_COUNTED:
            counted[key] = child
    child.inc()


#: Request counter children kept (routes x methods x statuses: a few hundred in practice).
_MAX_COUNTED = 4096
#: Each Unix socket connection's peer, read once (SO_PEERCRED is fixed at connect).
_PEERS: weakref.WeakKeyDictionary[asyncio.BaseTransport, str] = weakref.WeakKeyDictionary()


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in and out, and one log line per request: ``agent.audit`` for a mutation
    (who, what, result, time) at info, ``agent.access`` for anything else (at debug, at info
    when it failed)."""
    offered = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = (offered if _REQUEST_ID.match(offered)
                           else f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFF:012x}")
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
        # Any token is a method to aiohttp; the label set stays closed.
        method = request.method if request.method in _METHODS else "other"
        _count(request, method, route, status)
        if spec.mutating if spec else request.method not in ("GET", "HEAD", "OPTIONS"):
            await _audit(request, status, _peer(request), elapsed_ms)
        else:
            # Reads at debug (a --wait poll reads five times a second); a failed read stays
            # at info, like every mutation's audit line.
            level = logging.INFO if status >= 400 else logging.DEBUG
            if access_log.isEnabledFor(level):
                access_log.log(level, "request", extra={
                    "method": request.method, "path": request.path, "status": status,
                    "duration_ms": round(elapsed_ms, 2), "request_id": request[REQUEST_ID],
                    "peer": _peer(request), "principal": request[PRINCIPAL]})


def _peer(request: web.Request) -> str:
    """The caller: its address over TCP, its uid/gid/pid (SO_PEERCRED) on the Unix socket."""
    transport = request.transport
    if transport is None:
        return request.remote or "unix"
    known = _PEERS.get(transport)
    if known is None:
        sock = transport.get_extra_info("socket")
        known = peer_credentials(sock) or ""
        _PEERS[transport] = known
    return known or request.remote or "unix"


async def _audit(request: web.Request, status: int, peer: str, elapsed_ms: float) -> None:
    """One ``agent.audit`` line per mutating request: who, what, result (never a secret).
    Nothing a client sends can stop the line being written: a body that cannot be read or
    summarised is described by its size, and any failure here still writes the line."""
    try:
        raw = await request.read()
        body = summarise_body(raw, request.content_type, request.get(PARSED_BODY, UNPARSED))
    except Exception as err:  # e.g. a body that is not the gzip it says it is; still audited
        body = f"<unreadable body: {type(err).__name__}>"
    audit_log.info("audit", extra={
        "who": request[PRINCIPAL], "peer": peer, "method": request.method,
        "path": request.path, "query": request.query_string[:512] or "-",
        "body": body, "status": status,
        "result": "ok" if status < 400 else "refused" if status in (401, 403) else "failed",
        "duration_ms": round(elapsed_ms, 2), "request_id": request[REQUEST_ID]})


@web.middleware
async def query_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A query parameter the route does not take, or one given twice, is a 400 naming it: a
    typo such as ``?dryrun=true`` must not run the request for real."""
    spec = _spec_of(request)
    if spec is not None and request.query:
        known = {q.name for q in spec.query}
        names = [name for name, _ in request.query.items()]
        unknown = sorted({n for n in names if n not in known})
        twice = sorted({n for n in names if n in known and names.count(n) > 1})
        if unknown or twice:
            errors = [{"field": _shown(n), "reason": "unknown query parameter"}
                      for n in unknown[:8]]
            errors += [{"field": n, "reason": "given more than once"} for n in twice]
            takes = ", ".join(sorted(known)) or "none"
            raise BadRequest(f"query parameter(s) {', '.join(e['field'] for e in errors)}: "
                             f"{errors[0]['reason']}; {spec.path} takes {takes}",
                             errors=errors)
    return await handler(request)


def _shown(name: str) -> str:
    return name if len(name) <= 40 else name[:40] + "..."


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Mutations need a token with the route's scope; ``/v1`` reads need one with --auth-read."""
    spec = _spec_of(request)
    ctx = request.app[AGENT]
    if spec is not None and not spec.public:
        needs_token = spec.mutating or spec.identifies or ctx.node.settings.auth_read
        if needs_token:
            if not ctx.tokens.configured:
                raise Forbidden(
                    "mutating endpoints are disabled: no tokens are configured. Write lines "
                    "'name:token[:scope,...]' to a file readable only by the agent and start it "
                    "with --token-file FILE (or GPU_AGENT_TOKEN_FILE)")
            principal = ctx.tokens.authenticate(request.headers.get("Authorization"))
            request[PRINCIPAL] = principal.name
            scope = spec.scope or "read"
            if not spec.mutating:
                scope = next((s for s in spec.read_by if s in principal.scopes), scope)
            if not spec.identifies:
                principal.require(scope)
    readiness = ctx.node.readiness
    if spec is not None and spec.needs_recovery and not readiness.reconciled:
        if readiness.storage_blocked is not None and spec.mutating:
            code, path = readiness.storage_blocked
            raise StorageUnavailable(path, OSError(code, os.strerror(code)))
        # Before recovery ends, who holds what is not known yet: acknowledging anything now
        # could hand out a held device or lose an acknowledged claim.
        raise NotReady(f"agent not ready: {ctx.node.readiness.reason or 'starting'}; retry "
                       "once start-up recovery has finished", retry_after_s=1)
    return await handler(request)



#: A path token: a claim UID, a domain id (what goes into file names and other URLs).
_TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def path_token(request: web.Request, key: str, what: str) -> str:
    """The path parameter ``key`` when it is a token (1-128 of letters, digits, '.', '_', '-',
    starting with a letter or digit); :class:`InvalidRequest` naming it otherwise."""
    value = request.match_info[key]
    if not _TOKEN.match(value):
        shown = value if len(value) <= 64 else value[:64] + "..."
        raise InvalidRequest(f"{key}: {shown!r} is not {what} (1-128 of letters, digits, "
                             "'.', '_', '-', starting with a letter or digit)",
                             [{"field": key, "reason": "letters, digits, '.', '_', '-'"}])
    return value
