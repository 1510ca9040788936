"""``GET /v1/whoami``: the caller's token as the agent knows it (its name and scopes).

A client checks its token here before it needs it: the kubelet plugin does at start, so
that a wrong token is a readiness reason at once rather than the first prepare's error.
The route authenticates even where reads need no token (``--auth-read`` off) and changes
nothing; the token itself is never answered or logged, only its name.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, Field

from agent.api.context import AGENT
from agent.api.routing import json_response


class Identity(BaseModel):
    name: str = Field(description="The token's name (the first field of its line)")
    scopes: list[str] = Field(description="The scopes it holds, sorted")


async def whoami(request: web.Request) -> web.Response:
    # The auth middleware has authenticated the header already (a bad token never gets
    # here); asking again gives the scopes, which the request keeps no copy of.
    principal = request.app[AGENT].tokens.authenticate(request.headers.get("Authorization"))
    return json_response(Identity(name=principal.name, scopes=sorted(principal.scopes)))
