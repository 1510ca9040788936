"""The plugin's REST client of the agent (agent/kubeplugin/agent_client.py) against a real
agent: what each answer becomes."""

from __future__ import annotations

import signal

import pytest

from agent.kubeplugin.agent_client import UNREACHABLE_HINT, AgentClient
from agent.kubeplugin.errors import AgentRefused, AgentUnreachable
from tests.kubeplugin.conftest import NODE, Agent


async def test_slices_readiness_and_refusals(agent: Agent) -> None:
    """The slices come back as the agent's items; a ready agent is ready; a bad request is
    AgentRefused with the status and the problem body."""
    client = AgentClient(agent.process.socket_path, agent.token_file)
    try:
        answer = await client.resource_slices("1.35", None, 0)
        assert answer.items and all(s["spec"]["pool"]["name"] == NODE for s in answer.items)
        assert await client.ready() is True
        with pytest.raises(AgentRefused) as refused:
            await client.prepare("c-1", {"devices": []})
        assert refused.value.status == 422
        assert refused.value.problem["type"].endswith(refused.value.kind)
        assert "devices" in refused.value.detail
    finally:
        await client.close()


async def test_a_stopped_agent_is_unreachable_and_not_ready(agent: Agent) -> None:
    """With nothing on the socket, calls raise AgentUnreachable naming it and ready() is
    False with the reason, which says what to do."""
    client = AgentClient(agent.process.socket_path, agent.token_file)
    agent.process.stop(signal.SIGKILL)
    try:
        with pytest.raises(AgentUnreachable, match=str(agent.process.socket_path)):
            await client.unprepare("c-1", 5)
        assert await client.ready() is False
        said = await client.readiness() or ""
        assert said.startswith("agent unreachable") and said.endswith(UNREACHABLE_HINT), said
    finally:
        await client.close()
