"""DRA endpoint: this node's devices as ``resource.k8s.io/v1`` ResourceSlices.

Change notification: every 200 carries an ``ETag``; a request with ``If-None-Match`` naming
the current one answers 304, and with ``wait_s`` it is first held until the content differs
(200 with the new ETag) or the wait ends (304). The publisher long-polls this way instead of
re-reading on a timer."""

from __future__ import annotations

import math
import re
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from agent.api.connections import long_poll
from agent.api.context import AGENT
from agent.api.node import require_ready
from agent.api.routing import QueryParam, Route, json_response
from agent.dra.resource_slices import API_VERSION, KUBERNETES_VERSIONS
from agent.dra.service import Rendered
from agent.errors import InvalidRequest, NotReady

DEFAULT_KUBERNETES = (1, 35)
MAX_WAIT_S = 60.0
_CHOICES = ", ".join(f"{major}.{minor}" for major, minor in KUBERNETES_VERSIONS)


class ResourceSliceList(BaseModel):
    """A ``ResourceSliceList`` (``kubectl apply -f`` takes it as it is)."""

    model_config = ConfigDict(extra="allow")
    apiVersion: str = API_VERSION
    kind: str = "ResourceSliceList"
    metadata: dict[str, Any] = Field(default_factory=dict)
    items: list[dict[str, Any]] = Field(description="ResourceSlice objects of this node's pool")


def _version(text: str | None) -> tuple[int, int]:
    if text is None:
        return DEFAULT_KUBERNETES
    parts = text.removeprefix("v").split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        version = (0, 0)
    if version < KUBERNETES_VERSIONS[0]:
        raise InvalidRequest(f"kubernetes={text!r}: resource.k8s.io/v1 needs {_CHOICES} or newer",
                             errors=[{"field": "kubernetes", "reason": f"one of {_CHOICES}"}])
    # Newer servers keep the newest rules known (counters and devices in separate slices).
    return min(version, KUBERNETES_VERSIONS[-1])


#: Seconds as ASCII digits, an optional fraction, no sign, exponent, space or underscore
#: (``float()`` takes `` 5``, ``1_0``, ``1e1`` and every Unicode digit).
_SECONDS = re.compile(r"^(0|[1-9][0-9]?)(\.[0-9]{1,6})?\Z")


def parse_wait(text: str | None) -> float:
    """``wait_s`` as seconds from 0 to :data:`MAX_WAIT_S` (0 without it); anything else, or
    any other spelling, is an :class:`InvalidRequest` naming the field."""
    if text is None:
        return 0.0
    value = float(text) if _SECONDS.match(text) else math.nan
    if not 0 <= value <= MAX_WAIT_S:  # NaN fails too
        raise InvalidRequest(f"wait_s={text[:32]!r}: seconds from 0 to {MAX_WAIT_S:g} in ASCII "
                             "digits (e.g. 30 or 0.5)",
                             errors=[{"field": "wait_s",
                                      "reason": f"a number from 0 to {MAX_WAIT_S:g} in ASCII "
                                                "digits"}])
    return value


def _tags(header: str | None) -> set[str] | None:
    """The entity tags of ``If-None-Match`` (weak ones compared as strong: RFC 9110's weak
    comparison), ``{"*"}`` for any; None without the header."""
    if header is None:
        return None
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def _answer(rendered: Rendered, kubernetes: tuple[int, int]) -> web.Response:
    return json_response(ResourceSliceList(
        metadata={"annotations": {"gpu.nodeagent.dev/kubernetes": "{}.{}".format(*kubernetes)}},
        items=rendered.items), headers={"ETag": rendered.etag})


async def list_slices(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    if not ctx.node.topology.loaded:
        raise NotReady("topology not discovered yet")
    kubernetes = _version(request.query.get("kubernetes"))
    wait_s = parse_wait(request.query.get("wait_s"))
    tags = _tags(request.headers.get("If-None-Match"))
    service = ctx.node.resource_slices
    current = await service.render(kubernetes)
    if tags is None or not (current.etag in tags or "*" in tags):
        return _answer(current, kubernetes)
    if wait_s > 0:
        with long_poll(request):  # 503 with Retry-After once the listener holds its cap
            changed = await service.wait_for_change(kubernetes, current, wait_s)
        if changed is not None:
            return _answer(changed, kubernetes)
    return web.Response(status=304, headers={"ETag": current.etag})


async def release_waiters(app: web.Application) -> None:
    """At shutdown: answer every held request now (304), so that a long-poll never holds
    the agent's stop for the shutdown timeout."""
    await app[AGENT].node.resource_slices.release()


ROUTES = [
    Route("GET", "/v1/resourceslices", list_slices,
          "This node's devices as resource.k8s.io/v1 ResourceSlices (full GPUs, MIG devices; "
          "with --dynamic-mig partitionable MIG with shared counters). Answers an ETag; with "
          "If-None-Match naming it, 304 (after holding the request up to wait_s seconds for "
          "a change, which then answers 200 with the new ETag)", ResourceSliceList,
          tag="dra", errors=(422, 503), reconciled=True, read_by=("claims",),
          query=(QueryParam("kubernetes", {"type": "string",
                                           "enum": [f"{a}.{b}" for a, b in KUBERNETES_VERSIONS]},
                            "API server version: 1.35 and newer want counters and devices "
                            "in separate slices (default 1.35)"),
                 QueryParam("wait_s", {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
                            "With If-None-Match: hold the request up to this many seconds "
                            "until the content differs (default 0: answer at once)"))),
]
