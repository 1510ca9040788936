"""Compute domains: the IMEX node list of the domain this node is in, its IMEX daemon, and
the operator's answer to unreadable domain state."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, Field

from agent.api.body import parse_body
from agent.api.context import AGENT
from agent.api.models import Strict
from agent.api.node import require_ready
from agent.api.routing import Route, json_response, path_token
from agent.domains.config import MAX_PEERS
from agent.domains.service import DomainService, DomainView


class DomainRequest(Strict):
    peers: list[str | None] = Field(
        min_length=1, max_length=MAX_PEERS, description="The domain's seats in order (a "
        "seat is its IMEX node index; the length is the domain's size): each the IMEX IP "
        "address of the member holding it, or null for an empty seat; this node's address "
        "among them, none twice. The agent maps each seat's IMEX name (names) to it")


class DaemonModel(BaseModel):
    state: Literal["running", "stopped", "failed"] = Field(
        description="running; stopped: no claim needs it yet; failed: its last start failed "
        "(reason)")
    pid: int | None
    imex_state: str | None = Field(description="What nvidia-imex-ctl -q answers (READY, "
                                   "WAITING_FOR_PEERS, ...); null when it does not run")
    reason: str | None


class ImexNodeModel(BaseModel):
    index: int
    host: str
    status: str = Field(description="As nvidia-imex-ctl -N reports it: READY, UNAVAILABLE, ...")


class DomainModel(BaseModel):
    id: str
    address: str = Field(description="This node's IMEX address (--imex-address)")
    peers: list[str | None] = Field(description="Each seat's member address (null: empty)")
    names: list[str] = Field(description="Each seat's IMEX node name (nodes_config.cfg), the "
                             "same on every member; the daemon's /etc/hosts maps it to the "
                             "seat's address")
    daemon: DaemonModel
    nodes: list[ImexNodeModel] = Field(description="Every node as this node's daemon sees "
                                       "it (nvidia-imex-ctl -N -j); empty when it does not run")
    state: Literal["UP", "DEGRADED", "DOWN"] = Field(
        description="IMEX's Domain State: UP (every node READY and connected), DEGRADED, DOWN "
        "(this node's daemon not READY, or not running)")
    holders: list[str] = Field(description="Claims holding the domain's IMEX channel here")

    @classmethod
    def of(cls, view: DomainView) -> DomainModel:
        status = view.imex.status if view.imex is not None else "DOWN"
        return cls(
            id=view.domain.id, address=view.address, peers=list(view.domain.peers),
            names=list(view.domain.names),
            daemon=DaemonModel(state=view.daemon.state, pid=view.daemon.pid,
                               imex_state=view.daemon.imex_state, reason=view.daemon.reason),
            nodes=[ImexNodeModel(index=n.index, host=n.host, status=n.status)
                   for n in (view.imex.nodes if view.imex is not None else ())],
            state=status if status in ("UP", "DEGRADED") else "DOWN",
            holders=list(view.holders))


class DomainList(BaseModel):
    domains: list[DomainModel] = Field(description="The domain this node is in (at most one)")


class DomainStateAccepted(BaseModel):
    accepted: bool


def _service(request: web.Request) -> DomainService:
    ctx = request.app[AGENT]
    require_ready(ctx)
    return ctx.node.domains


def _domain(request: web.Request) -> str:
    return path_token(request, "domain", "a domain id")


async def put_domain(request: web.Request) -> web.Response:
    domain = _domain(request)
    body = await parse_body(request, DomainRequest)
    view, _ = await _service(request).configure(domain, body.peers)
    return json_response(DomainModel.of(view))


async def delete_domain(request: web.Request) -> web.Response:
    await _service(request).leave(_domain(request))
    return web.Response(status=204)


async def list_domains(request: web.Request) -> web.Response:
    views = await _service(request).views()
    return json_response(DomainList(domains=[DomainModel.of(v) for v in views]))


async def get_domain(request: web.Request) -> web.Response:
    view = await _service(request).view(_domain(request))
    return json_response(DomainModel.of(view))


async def accept_domain_state(request: web.Request) -> web.Response:
    await _service(request).accept_empty_state()
    return json_response(DomainStateAccepted(accepted=True))


ROUTES = [
    Route("PUT", "/v1/domains/{domain}", put_domain,
          "Join a compute domain: its seats' addresses (idempotent; other addresses for as "
          "many seats reach a running IMEX daemon without a restart, through its hosts file "
          "and SIGUSR1; another size restarts it)", DomainModel,
          body=DomainRequest, scope="claims", tag="domains", errors=(409, 422, 503)),
    Route("DELETE", "/v1/domains/{domain}", delete_domain,
          "Leave a compute domain no claim holds here: its IMEX daemon stopped, its files "
          "removed (an unknown domain is a success)", None, status=204, scope="claims",
          tag="domains", errors=(409, 422, 503)),
    Route("GET", "/v1/domains", list_domains,
          "The compute domain this node is in (0 or 1), its IMEX daemon and nodes",
          DomainList, tag="domains", errors=(409, 503), reconciled=True, read_by=("claims",)),
    Route("GET", "/v1/domains/{domain}", get_domain, "One compute domain", DomainModel,
          tag="domains", errors=(404, 409, 422, 503), reconciled=True, read_by=("claims",)),
    Route("POST", "/v1/admin/domain-state", accept_domain_state,
          "Remediation: accept empty compute-domain state after it was unreadable (check "
          "and stop this node's IMEX daemon by hand first)", DomainStateAccepted,
          scope="admin", tag="admin", errors=(409, 503)),
]
