"""What the handlers share, as typed application keys (no untyped state bags)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from agent.api.auth import TokenStore
from agent.wiring import Node


@dataclass
class AgentContext:
    """The node the API serves and the tokens it accepts (reloaded on SIGHUP)."""

    node: Node
    tokens: TokenStore


AGENT = web.AppKey("agent", AgentContext)
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
REQUEST_ID = web.RequestKey("request_id", str)
PRINCIPAL = web.RequestKey("principal", str)
