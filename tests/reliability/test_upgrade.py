"""Upgrade (issue 12): an agent started on a state directory that an earlier release wrote
while in use recovers everything. The fixture is today's main's own files, kept in today's
formats forever: ``tests/data/upgrade/README.md`` says how it was made."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

UPGRADE = Path(__file__).resolve().parents[1] / "data" / "upgrade"
BASELINES = sorted(p.name for p in UPGRADE.iterdir() if (p / "expected.json").exists())


def _layout(agent: AgentProcess, gpu: str) -> list[str]:
    body = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in body["instances"])


def _settled(agent: AgentProcess, timeout: float = 30) -> list[dict[str, Any]]:
    """The transitions once every one of them is terminal (a re-apply may follow recovery)."""
    def settled() -> dict[str, Any] | None:
        reply = agent.request("GET", "/v1/transitions", token=None)
        assert reply.status == 200, reply.body
        body: dict[str, Any] = reply.body
        return body if all(t["terminal"] for t in body["transitions"]) else None
    transitions: list[dict[str, Any]] = wait_for(
        settled, "every transition to end", timeout, every_s=0.05)["transitions"]
    return transitions


@pytest.mark.parametrize("baseline", BASELINES)
def test_state_written_by_an_earlier_agent_is_recovered(tmp_path: Path, baseline: str) -> None:
    """An agent started on a state directory written by an earlier main with three prepared
    claims (whole GPU, MIG device, slice) and an open journal entry keeps every claim with its
    devices and CDI spec, and resolves the journal: every baseline was killed mid-apply, the
    hardware showing neither layout (tests/data/upgrade/README.md), so it is rolled back."""
    fixture = UPGRADE / baseline
    expected = json.loads((fixture / "expected.json").read_text())
    state = tmp_path / "state"
    shutil.copytree(fixture / "state", state)
    (state / "tokens").chmod(0o600)  # git keeps no modes; the agent's token file is 0600
    agent = start_agent(state)
    try:
        claims = {c["uid"]: c for c in
                  agent.request("GET", "/v1/claims", token=None).body["claims"]}
        assert set(claims) == set(expected["claims"])
        hardware = {d["uuid"] for g in agent.request("GET", "/v1/sim").body["gpus"]
                    for d in g["mig_devices"]} | {
            g["uuid"] for g in agent.request("GET", "/v1/gpus", token=None).body["gpus"]}
        specs = {n for s in agent.request("GET", "/v1/cdi", token=None).body["specs"]
                 for n in s["devices"]}
        for uid, want in expected["claims"].items():
            claim = claims[uid]
            assert claim["state"] == "prepare_completed", claim
            assert [d["uuid"] for d in claim["devices"]] == want["devices"], claim
            assert set(want["devices"]) <= hardware, f"{uid}: its device is gone"
            assert [n for d in claim["devices"] for n in d["cdi_devices"]] == \
                want["cdi_devices"]
            assert set(want["cdi_devices"]) <= specs, f"{uid}: not in /v1/cdi"
            spec = state / "cdi" / f"k8s.gpu.nodeagent.dev-claim_{uid}.json"
            assert spec.exists(), spec
        transitions = _settled(agent)
        recovered = next((t for t in transitions if t["id"] == expected["transition"]["id"]),
                         None)
        assert recovered is not None, transitions
        assert recovered["state"] == "rolled_back", recovered
        assert not list((state / "mig" / "journal").glob("*.json"))
        gpu = next(g["index"] for g in agent.request("GET", "/v1/gpus", token=None).body["gpus"]
                   if g["uuid"] == expected["transition"]["gpu"])
        assert _layout(agent, str(gpu)) == expected["transition"]["old"]
    finally:
        agent.stop(signal.SIGKILL)
