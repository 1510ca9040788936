"""DRA endpoint: this node's devices as ``resource.k8s.io/v1`` ResourceSlices."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from agent.api.context import AGENT
from agent.api.node import require_ready
from agent.api.routing import QueryParam, Route, json_response
from agent.dra.slices import API_VERSION, KUBERNETES_VERSIONS
from agent.errors import InvalidRequest, NotReady

DEFAULT_KUBERNETES = (1, 35)
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
    # Newer servers keep the 1.35 rules (counters and devices in separate slices).
    return min(version, KUBERNETES_VERSIONS[-1])


async def list_slices(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    require_ready(ctx)
    if not ctx.node.topology.loaded:
        raise NotReady("topology not discovered yet")
    kubernetes = _version(request.query.get("kubernetes"))
    items = await ctx.node.slices.slices(kubernetes)
    return json_response(ResourceSliceList(
        metadata={"annotations": {"gpu.nodeagent.dev/kubernetes": "{}.{}".format(*kubernetes)}},
        items=items))


ROUTES = [
    Route("GET", "/v1/resourceslices", list_slices,
          "This node's devices as resource.k8s.io/v1 ResourceSlices (full GPUs, MIG devices; "
          "with --dynamic-mig partitionable MIG with shared counters)", ResourceSliceList,
          tag="dra", errors=(422, 503), reconciled=True, read_by=("claims",),
          query=(QueryParam("kubernetes", {"type": "string", "enum": ["1.34", "1.35"]},
                            "API server version: 1.35 and newer want counters and devices "
                            "in separate slices (default 1.35)"),)),
]
