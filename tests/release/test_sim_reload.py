"""The simulator's driver reload and GPU reset as on a real node (issue 24 item 9): the
kernel's boot id stays, so a claim prepared after a reload is not taken for a previous
boot's at the next start; the MIG geometry the reload or reset emptied is re-applied by the
agent, as at start-up after a real reload, never reported as changed behind its back."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

BALANCED = ["1g.10gb@2:1", "1g.10gb@3:1", "2g.20gb@0:2", "3g.40gb@4:4"]


def _mig(agent: AgentProcess, gpu: str) -> dict[str, Any]:
    body: dict[str, Any] = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    return body


def _layout(agent: AgentProcess, gpu: str) -> list[str]:
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in _mig(agent, gpu)["instances"])


def _settled(agent: AgentProcess, gpu: str, want: list[str]) -> None:
    def done() -> bool:
        body = agent.request("GET", "/v1/transitions", token=None).body
        return all(t["terminal"] for t in body["transitions"]) and _layout(agent, gpu) == want
    wait_for(done, f"GPU {gpu} to show {want}", 30, every_s=0.05)


@pytest.mark.parametrize("control", ["reload-driver", "reset"])
def test_reload_keeps_the_boot_and_reapplies_the_geometry(tmp_path: Path, control: str) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        reply = agent.request("PUT", "/v1/gpus/1/mig",
                              {"profiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]})
        assert reply.status in (200, 202), reply.body
        _settled(agent, "1", BALANCED)
        boot = agent.request("GET", "/v1/node", token=None).body["boot_id"]
        path, body = ("/v1/sim/reload-driver", None) if control == "reload-driver" else \
            ("/v1/sim/reset", {"gpu": "1"})
        reply = agent.request("POST", path, body)
        assert reply.status == 204, reply.body
        assert agent.request("GET", "/v1/sim").body["boot_id"] == boot
        assert agent.request("GET", "/v1/node", token=None).body["boot_id"] == boot
        # Re-applied by the running agent: not drift.
        _settled(agent, "1", BALANCED)
        assert _mig(agent, "1")["drift"] is None
        events = agent.request("GET", "/v1/events", token=None).body["events"]
        assert any(e["kind"] == "mig.reapply" for e in events), events
        assert not any(e["kind"] == "mig.drift" for e in events), events
        reply = agent.request("PUT", "/v1/claims/after", {"devices": [{"kind": "gpu",
                                                                        "device": "0"}]})
        assert reply.status == 200, reply.body
    finally:
        agent.stop(signal.SIGTERM)
    agent = start_agent(state)
    try:
        claim = agent.request("GET", "/v1/claims/after", token=None).body
        assert claim["state"] == "prepare_completed", claim
        assert _layout(agent, "1") == BALANCED
        assert _mig(agent, "1")["drift"] is None
    finally:
        agent.stop(signal.SIGKILL)
