"""What docs/cookbook.md says a cancel of a MIG transition answers, in each state it can be
in: draining (200, it ends aborted with the GPU unchanged), changing the GPU (409, it
finishes by itself), ended (200, the transition as it ended, nothing changed). In-process over
a simulated DGX H100."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from tests.docs.scripts import COOKBOOK
from tests.service_node import open_services
from tests.waiting import until

TOKEN = "t1"


@dataclass
class Api:
    client: TestClient[Any, Any]

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        reply = await self.client.request(method, path, json=body,
                                          headers={"Authorization": f"Bearer {TOKEN}"})
        text = await reply.text()
        return reply.status, json.loads(text) if text else None

    async def state(self, tid: str) -> str:
        status, body = await self.call("GET", f"/v1/transitions/{tid}")
        assert status == 200, body
        return str(body["state"])

    async def ended(self, tid: str) -> str:
        terminal = {"succeeded", "aborted", "rolled_back", "failed", "pending_reset"}
        return await until(lambda: self.state_in(tid, terminal), f"transition {tid} to end", 30)

    async def state_in(self, tid: str, states: set[str]) -> str | None:
        state = await self.state(tid)
        return state if state in states else None

    async def layout(self, gpu: int) -> list[str]:
        _, body = await self.call("GET", f"/v1/gpus/{gpu}")
        return sorted(d["profile"] for d in body["mig_devices"])


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Api]:
    node = await open_services(tmp_path / "node")
    (tmp_path / "tokens").write_text(f"admin:{TOKEN}:admin\n")
    (tmp_path / "tokens").chmod(0o600)
    ctx = AgentContext(node=node.node, tokens=TokenStore.load(tmp_path / "tokens"))
    client: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
    try:
        yield Api(client)
    finally:
        await node.close()


def test_the_cookbook_says_what_a_cancel_answers() -> None:
    """The cookbook's text names each answer this module holds."""
    text = " ".join(COOKBOOK.read_text().split())
    for claim in ("cancelled while it is planned or draining: it then ends `aborted`",
                  "a cancel is refused with 409", "has already ended changes nothing and "
                  "answers 200"):
        assert claim in text


async def test_a_draining_transition_cancelled_ends_aborted_and_changes_nothing(
        api: Api) -> None:
    """Cancelled while draining: 200, ``aborted``, the old layout kept; again: the same."""
    status, body = await api.call("PUT", "/v1/gpus/3/mig", {"profiles": ["7g.80gb"]})
    assert status == 202, body
    assert await api.ended(body["transition"]["id"]) == "succeeded"
    _, gpu = await api.call("GET", "/v1/gpus/3")
    status, _ = await api.call("POST", "/v1/sim/processes",
                               {"device": gpu["mig_devices"][0]["uuid"], "pid": 99})
    assert status == 201
    status, body = await api.call("PUT", "/v1/gpus/3/mig", {
        "mig_enabled": False, "drain": {"policy": "wait", "timeout_s": 60}})
    assert status == 202, body
    tid = body["transition"]["id"]
    await until(lambda: api.state_in(tid, {"draining"}), "the transition to drain")
    for _ in range(2):
        status, body = await api.call("POST", f"/v1/transitions/{tid}/cancel")
        assert (status, body["state"]) == (200, "aborted"), body
    assert await api.layout(3) == ["7g.80gb"]


async def test_a_transition_changing_the_gpu_refuses_a_cancel_and_an_ended_one_answers_it(
        api: Api) -> None:
    """Cancelled while applying: 409 saying it finishes by itself, and it does; cancelled
    once ended: 200 with the transition as it ended, its layout kept."""
    status, _ = await api.call("PUT", "/v1/sim/latency",
                               {"nvmlDeviceCreateGpuInstanceWithPlacement": 1.0})
    assert status == 200
    status, body = await api.call("PUT", "/v1/gpus/4/mig", {"profiles": ["3g.40gb", "3g.40gb"]})
    assert status == 202, body
    tid = body["transition"]["id"]
    await until(lambda: api.state_in(tid, {"applying"}), "the transition to apply")
    status, body = await api.call("POST", f"/v1/transitions/{tid}/cancel")
    assert status == 409, body
    assert "will finish or roll back" in body["detail"]
    status, _ = await api.call("PUT", "/v1/sim/latency", {})
    assert await api.ended(tid) == "succeeded"
    status, body = await api.call("POST", f"/v1/transitions/{tid}/cancel")
    assert (status, body["state"], body["id"]) == (200, "succeeded", tid), body
    assert await api.layout(4) == ["3g.40gb", "3g.40gb"]
