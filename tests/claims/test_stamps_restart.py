"""Ordering stamps survive a restart of a real agent process (killed, not stopped): the
claim's own stamp and each tombstone's are in the checkpoint before a request is answered."""

from __future__ import annotations

import signal
from pathlib import Path

from agent.claims.checkpoint import decode
from tests.agent_process import AgentProcess, start_agent
from tests.stamps import stamp


def _prepare(agent: AgentProcess, uid: str, device: str, offset: int) -> int:
    return agent.request("PUT", f"/v1/claims/{uid}", {
        "devices": [{"kind": "gpu", "device": device}], "issued_at_ns": stamp(offset),
        "metadata": {"resource_version": f"rv-{offset}"}}).status


def _unprepare(agent: AgentProcess, uid: str, offset: int) -> int:
    return agent.request("DELETE", f"/v1/claims/{uid}?issued_at_ns={stamp(offset)}").status


def test_stamps_and_stamped_tombstones_survive_a_kill(tmp_path: Path) -> None:
    """After SIGKILL and a restart, a late prepare of an unprepared claim is still refused
    while a newer one prepares it; a late unprepare of a prepared claim is still ignored;
    the claim shows the stamp and resource_version it was prepared with."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        assert _prepare(agent, "gone", "0", 10) == 200
        assert _unprepare(agent, "gone", 20) == 204
        assert _prepare(agent, "kept", "1", 30) == 200
        data = decode((state / "claims.checkpoint").read_bytes())
        assert data.tombstone_stamps == {"gone": stamp(20)}
        assert data.claims["kept"].issued_at_ns == stamp(30)
        agent.stop(signal.SIGKILL)
        agent = start_agent(state)
        late = agent.request("PUT", "/v1/claims/gone", {
            "devices": [{"kind": "gpu", "device": "0"}], "issued_at_ns": stamp(15)})
        assert late.status == 409 and late.body["type"].endswith("/claim-unprepared")
        assert _prepare(agent, "gone", "0", 25) == 200  # sent after the unprepare
        assert _unprepare(agent, "kept", 29) == 204  # sent before the prepare: ignored
        kept = agent.request("GET", "/v1/claims/kept")
        assert kept.status == 200
        assert kept.body["issued_at_ns"] == stamp(30)
        assert kept.body["metadata"]["resource_version"] == "rv-30"
    finally:
        agent.stop(signal.SIGKILL)
