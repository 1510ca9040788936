"""``POST /v1/sim/xid`` with a recovery action (in-process app over a simulated node): the
action lands in ``GET /v1/sim``; bad input is a 422 problem naming the field and changes
nothing (no XID raised, no action set)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.gpu.backend import Backend
from agent.gpu.sim.hardware import EventSet
from agent.gpu.sim.node import SimulatedNode
from agent.settings import resolve
from agent.wiring import build_node

ADMIN = {"Authorization": "Bearer o1"}
Client = TestClient[Any, Any]
MakeApi = Callable[[str], Awaitable[tuple[Client, SimulatedNode]]]


@pytest.fixture
async def make_api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[MakeApi]:
    nodes: list[SimulatedNode] = []

    async def make(preset: str) -> tuple[Client, SimulatedNode]:
        settings = resolve({"simulate": preset, "state_dir": str(tmp_path / preset)}, env={})
        node = SimulatedNode(preset, settings.state_dir, settings.proc_root)
        nodes.append(node)
        (tmp_path / "tokens").write_text("ops:o1:admin\n")
        (tmp_path / "tokens").chmod(0o600)
        agent_node = build_node(settings, Backend(nvml=node.nvml, name=f"simulated:{preset}",
                                                  sim=node, sys_root=node.sys_root))
        await agent_node.session.initialise()
        await agent_node.inventory.load()
        agent_node.readiness.reconciled = True
        agent_node.readiness.set(None)
        app: web.Application = build_app(AgentContext(
            node=agent_node, tokens=TokenStore.load(tmp_path / "tokens")))
        client: Client = await aiohttp_client(app)
        return client, node

    yield make
    for node in nodes:
        node.close()


def _xid_set(node: SimulatedNode, index: int) -> EventSet:
    """An event set for one GPU's XIDs; the simulator's own record of it (its queue)."""
    nvml = node.nvml
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index),
                                  nvml.nvmlEventTypeXidCriticalError, nvml.nvmlEventSetCreate())
    return node.hardware.event_sets[-1]


async def _actions(client: Client) -> list[str | None]:
    body = await (await client.get("/v1/sim", headers=ADMIN)).json()
    return [g["recovery_action"] for g in body["gpus"]]


async def test_an_xid_with_a_named_action(make_api: MakeApi) -> None:
    client, _ = await make_api("dgx-h100")
    reply = await client.post("/v1/sim/xid", headers=ADMIN,
                              json={"gpu": "2", "xid": 31, "recovery_action": "drain-p2p"})
    assert reply.status == 202
    reply = await client.post("/v1/sim/xid", headers=ADMIN, json={"gpu": "4", "xid": 48})
    assert reply.status == 202
    assert await _actions(client) == ["none", "none", "drain-p2p", "none", "reset",
                                      "none", "none", "none"]


@pytest.mark.parametrize(("body", "field"), [
    ({"gpu": "1", "xid": 48, "recovery_action": "explode"}, "recovery_action"),
    ({"gpu": "1", "xid": 48, "recovery_action": 2}, "recovery_action"),
    ({"gpu": "1", "xid": 48, "recovery_action": "RESET"}, "recovery_action"),
    ({"gpu": "1", "xid": 48, "recovery": "reset"}, "recovery"),  # unknown fields too
])
async def test_bad_recovery_actions_are_422_and_change_nothing(
        make_api: MakeApi, body: dict[str, Any], field: str) -> None:
    client, node = await make_api("dgx-h100")
    xids = _xid_set(node, 1)
    reply = await client.post("/v1/sim/xid", headers=ADMIN, json=body)
    assert reply.status == 422
    assert reply.content_type == "application/problem+json"
    problem = await reply.json()
    assert field in [e["field"] for e in problem["errors"]]
    assert await _actions(client) == ["none"] * 8
    assert not xids.queue  # no XID raised


async def test_an_action_on_a_driver_without_one_is_422(make_api: MakeApi) -> None:
    """dgx-a100-r535 reports no recovery action: naming one is refused before the XID is
    raised; without one the XID goes through, and ``GET /v1/sim`` shows no action."""
    client, node = await make_api("dgx-a100-r535")
    xids = _xid_set(node, 0)
    reply = await client.post("/v1/sim/xid", headers=ADMIN,
                              json={"gpu": "0", "xid": 48, "recovery_action": "reset"})
    assert reply.status == 422
    problem = await reply.json()
    assert [e["field"] for e in problem["errors"]] == ["recovery_action"]
    assert "535.247.01" in problem["detail"]
    assert not xids.queue  # no XID raised
    assert (await client.post("/v1/sim/xid", headers=ADMIN,
                              json={"gpu": "0", "xid": 48})).status == 202
    assert [int(e.data) for e in xids.queue] == [48]
    assert await _actions(client) == [None] * 8
