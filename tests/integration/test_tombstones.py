"""Issue 13, item 9 (tombstone amplification): unpreparing claims this agent never prepared
costs nothing durable, tombstones are bounded, and late prepare retries are still refused."""

from __future__ import annotations

from pathlib import Path

from agent.claims.checkpoint import decode
from agent.claims.tombstones import MAX_TOMBSTONES
from tests.agent_process import start_agent


def test_unprepares_of_unknown_claims_leave_the_checkpoint_as_it_was(tmp_path: Path) -> None:
    """2,000 unprepares of UIDs never prepared here write nothing: the checkpoint's bytes do
    not change, and a late prepare of one of those UIDs is still refused (from memory)."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        assert agent.request("PUT", "/v1/claims/kept", {
            "devices": [{"kind": "gpu", "device": "0"}]}).status == 200
        before = (state / "claims.checkpoint").read_bytes()
        for i in range(2000):
            assert agent.request("DELETE", f"/v1/claims/never-{i}").status == 204
        assert (state / "claims.checkpoint").read_bytes() == before
        late = agent.request("PUT", "/v1/claims/never-7", {
            "devices": [{"kind": "gpu", "device": "1"}]})
        assert late.status == 409 and late.body["type"].endswith("/claim-unprepared")
    finally:
        agent.stop()


def test_tombstones_of_prepared_claims_are_durable_and_bounded(tmp_path: Path) -> None:
    """An unprepared claim's tombstone survives a restart (its late retry is refused after
    it), and the checkpoint never holds more than MAX_TOMBSTONES of them."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        device = {"devices": [{"kind": "gpu", "device": "0"}]}
        assert agent.request("PUT", "/v1/claims/once", device).status == 200
        assert agent.request("DELETE", "/v1/claims/once").status == 204
        agent.stop()
        agent = start_agent(state)
        late = agent.request("PUT", "/v1/claims/once", device)
        assert late.status == 409 and late.body["type"].endswith("/claim-unprepared")
        data = decode((state / "claims.checkpoint").read_bytes())
        assert "once" in data.tombstones
        assert len(data.tombstones) <= MAX_TOMBSTONES
    finally:
        agent.stop()
