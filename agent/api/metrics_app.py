"""The dedicated metrics listener (``--metrics-listen``; port 9400 in deployments, where
dcgm-exporter listens): ``/metrics``, ``/healthz`` and ``/readyz`` only, never behind a token,
so Prometheus and kubelet probes always work whatever the API's auth settings."""

from __future__ import annotations

from aiohttp import web

from agent.api.app import CORE_ROUTES
from agent.api.context import AGENT, MAX_BODY_BYTES, AgentContext
from agent.api.problems import problem_middleware
from agent.api.routing import query_middleware, register, request_middleware

PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
# Only GETs arrive here; anything with a body is not for this listener.
_MAX_BODY_BYTES = 4096


def build_metrics_app(ctx: AgentContext) -> web.Application:
    """The metrics listener's application: probes and ``/metrics``, every other path or
    method a 404/405 problem."""
    app = web.Application(client_max_size=_MAX_BODY_BYTES,
                          middlewares=[request_middleware, problem_middleware,
                                       query_middleware])
    app[AGENT] = ctx
    # The problem middleware reads it for a 413; without it every 404 and 405 here was a 500.
    app[MAX_BODY_BYTES] = _MAX_BODY_BYTES
    register(app, [route for route in CORE_ROUTES if route.path in PATHS])
    return app
