"""The API in-process over a simulated node: authorisation rules and problem responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AGENT, AgentContext
from agent.gpu.backend import Backend
from agent.gpu.sim.node import SimulatedNode
from agent.settings import resolve
from agent.wiring import build_node

ClientMaker = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def make_client(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[ClientMaker]:
    nodes: list[SimulatedNode] = []

    async def make(*, tokens: str | None = None, auth_read: bool = False,
                   ready: bool = True) -> TestClient[Any, Any]:
        settings = resolve({"simulate": "dgx-h100", "state_dir": str(tmp_path / "state"),
                            "auth_read": auth_read or None}, env={})
        node = SimulatedNode("dgx-h100", settings.state_dir, settings.proc_root)
        nodes.append(node)
        store = TokenStore.empty()
        if tokens is not None:
            (tmp_path / "tokens").write_text(tokens)
            (tmp_path / "tokens").chmod(0o600)
            store = TokenStore.load(tmp_path / "tokens")
        agent_node = build_node(settings, Backend(nvml=node.nvml, name="simulated:dgx-h100",
                                                  sim=node, sys_root=node.sys_root))
        ctx = AgentContext(node=agent_node, tokens=store)
        if ready:  # the inventory up and recovery done, without the background threads
            await agent_node.session.initialise()
            await agent_node.inventory.load()
            agent_node.readiness.reconciled = True
            agent_node.readiness.set(None)
        app: web.Application = build_app(ctx)
        client: TestClient[Any, Any] = await aiohttp_client(app)
        return client

    yield make
    for node in nodes:
        node.close()


FAULT = {"function": "nvmlDeviceGetName", "error": "NVML_ERROR_UNKNOWN", "skip": 1000}


async def test_without_tokens_mutations_are_forbidden_with_advice(make_client: ClientMaker) -> None:
    client = await make_client()
    reply = await client.post("/v1/sim/faults", json=FAULT,
                              headers={"Authorization": "Bearer anything"})
    assert reply.status == 403
    body = await reply.json(content_type="application/problem+json")
    assert "--token-file" in body["detail"]
    assert (await client.get("/v1/gpus")).status == 200


async def test_scopes_are_enforced(make_client: ClientMaker) -> None:
    client = await make_client(tokens="reader:r1:read\nops:o1:admin\n")
    denied = await client.post("/v1/sim/faults", json=FAULT, headers={"Authorization": "Bearer r1"})
    assert denied.status == 403
    assert "lacks the 'admin' scope" in (await denied.json(
        content_type="application/problem+json"))["detail"]
    allowed = await client.post("/v1/sim/faults", json=FAULT,
                                headers={"Authorization": "Bearer o1"})
    assert allowed.status == 201


async def test_auth_read_closes_reads_but_not_probes(make_client: ClientMaker) -> None:
    client = await make_client(tokens="reader:r1:read\n", auth_read=True)
    assert (await client.get("/v1/gpus")).status == 401
    assert (await client.get("/v1/gpus", headers={"Authorization": "Bearer r1"})).status == 200
    for public in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert (await client.get(public)).status == 200, public


async def test_not_ready_answers_503_problems(make_client: ClientMaker) -> None:
    client = await make_client(ready=False)
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["reason"] == "starting"
    for path in ("/v1/gpus", "/v1/gpus/0", "/v1/node"):
        reply = await client.get(path)
        assert reply.status == 503, path
        assert reply.content_type == "application/problem+json"
        assert int(reply.headers["Retry-After"]) >= 1, path


async def test_request_id_is_echoed_or_generated(make_client: ClientMaker) -> None:
    client = await make_client()
    echoed = await client.get("/healthz", headers={"X-Request-Id": "abc-123"})
    assert echoed.headers["X-Request-Id"] == "abc-123"
    junk = await client.get("/healthz", headers={"X-Request-Id": "bad id with spaces"})
    assert junk.headers["X-Request-Id"] != "bad id with spaces"
    assert len(junk.headers["X-Request-Id"]) == 32


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/sim/processes", {"device": "GPU-unknown"}, 404),
    ("DELETE", "/v1/sim/processes/99999", None, 404),
    ("DELETE", "/v1/sim/processes/abc", None, 422),
    ("DELETE", "/v1/sim/processes/\u00b2", None, 422),  # "²".isdigit(), int("²") fails
    ("DELETE", "/v1/sim/processes/" + "9" * 5000, None, 422),
    ("POST", "/v1/sim/faults", {"function": "nvmlNoSuchCall", "error": "NVML_ERROR_UNKNOWN"}, 422),
    ("POST", "/v1/sim/faults", {"function": "nvmlDeviceGetName", "error": "NOPE"}, 422),
    ("PUT", "/v1/sim/latency", {"nvmlDeviceGetName": -1}, 422),
    ("PUT", "/v1/sim/latency", {"nvmlDeviceGetName": "fast"}, 422),
    ("POST", "/v1/sim/xid", {"gpu": "GPU-unknown", "xid": 79}, 404),
])
async def test_bad_simulation_requests_are_4xx_and_change_nothing(
        make_client: ClientMaker, method: str, path: str, body: Any, status: int) -> None:
    client = await make_client(tokens="ops:o1\n")
    auth = {"Authorization": "Bearer o1"}
    before = await (await client.get("/v1/sim", headers=auth)).json()
    reply = await client.request(method, path, json=body, headers=auth)
    assert reply.status == status
    assert reply.content_type == "application/problem+json"
    after = await (await client.get("/v1/sim", headers=auth)).json()
    assert {k: after[k] for k in ("processes", "faults", "latencies")} == \
        {k: before[k] for k in ("processes", "faults", "latencies")}


@pytest.mark.parametrize(("auth_read", "token", "status"), [
    (False, None, 200),  # a mutation would need the ops token here
    (True, None, 401),
    (True, "r1", 200),
], ids=["open without --auth-read", "closed by --auth-read", "read token under --auth-read"])
async def test_a_query_by_post_is_authorised_like_a_read(
        make_client: ClientMaker, auth_read: bool, token: str | None, status: int) -> None:
    """POST /v1/topology/select changes nothing, so it is authorised as a read: open without
    --auth-read to a caller with no token, closed by --auth-read but to a read token."""
    client = await make_client(tokens="reader:r1:read\nops:o1:admin\n", auth_read=auth_read)
    await client.app[AGENT].node.topology.load()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = await client.post("/v1/topology/select", json={"count": 2}, headers=headers)
    assert reply.status == status, await reply.text()


@pytest.mark.parametrize(("path", "status"), [
    ("/v1/gpus/\u00b2", 404),  # found by a 4,900-request fuzz run: was a 500
    ("/v1/gpus/\u0663", 404),  # an Arabic-Indic 3 is no GPU index either
    ("/v1/gpus/" + "9" * 5000, 404),  # beyond int()'s 4,300 digits
    ("/v1/events?since=\u00b2", 422),
    ("/v1/events?since=" + "9" * 5000, 422),
])
async def test_unicode_and_huge_numbers_are_4xx(make_client: ClientMaker, path: str,
                                                status: int) -> None:
    client = await make_client()
    reply = await client.get(path)
    assert reply.status == status, await reply.text()
    assert reply.content_type == "application/problem+json"
