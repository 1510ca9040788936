"""What docs/upgrade.md states, step by step, with real agent processes on one state
directory: a restart (an upgrade or a downgrade of the agent is a restart on the same state
directory) keeps prepared claims, the MIG layout and the claims' MPS daemons; a driver reload
while the agent is down is told from a hand-made change and its emptied geometry re-applied;
a state file from a newer agent is read for what this one knows, and one that says something
this agent cannot understand freezes claims instead of being guessed at."""

from __future__ import annotations

import json
import signal
import tempfile
from pathlib import Path
from typing import Any

from agent.claims.checkpoint import KIND as CHECKPOINT
from agent.durable import encode_envelope
from agent.gpu.sim.node import SimulatedNode
from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

BALANCED = ["1g.10gb@2:1", "1g.10gb@3:1", "2g.20gb@0:2", "3g.40gb@4:4"]
MPS_50 = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}


def _layout(agent: AgentProcess, gpu: str) -> list[str]:
    body = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in body["instances"])


def _apply(agent: AgentProcess, gpu: str) -> None:
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig",
                          {"profiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]})
    assert reply.status in (200, 202), reply.body
    _settled(agent, gpu, BALANCED)


def _settled(agent: AgentProcess, gpu: str, want: list[str]) -> None:
    def done() -> bool:
        body = agent.request("GET", "/v1/transitions", token=None).body
        return all(t["terminal"] for t in body["transitions"]) and _layout(agent, gpu) == want
    wait_for(done, f"GPU {gpu} to show {want}", 30, every_s=0.05)


def _claim(agent: AgentProcess, uid: str) -> dict[str, Any]:
    body: dict[str, Any] = agent.request("GET", f"/v1/claims/{uid}", token=None).body
    return body


def test_restart_keeps_claims_layout_and_no_drift(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        _apply(agent, "1")
        mig = agent.request("GET", "/v1/gpus/1/mig", token=None).body["instances"]
        device = next(i for i in mig if i["profile"] == "3g.40gb")
        for uid, body in (("whole", {"kind": "gpu", "device": "0"}),
                          ("mig", {"kind": "gpu", "device": f"1:{device['gi_id']}"})):
            reply = agent.request("PUT", f"/v1/claims/{uid}", {"devices": [body]})
            assert reply.status == 200, reply.body
        before = {uid: _claim(agent, uid)["devices"] for uid in ("whole", "mig")}
    finally:
        agent.stop(signal.SIGTERM)
    agent = start_agent(state)
    try:
        for uid, devices in before.items():
            claim = _claim(agent, uid)
            assert claim["state"] == "prepare_completed", claim
            assert claim["devices"] == devices
        assert _layout(agent, "1") == BALANCED
        assert agent.request("GET", "/v1/gpus/1/mig", token=None).body["drift"] is None
    finally:
        agent.stop(signal.SIGKILL)


def test_restart_keeps_the_mps_daemon(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with tempfile.TemporaryDirectory(prefix="mps-") as mps_root:
        extra = ["--mps-root", mps_root]
        agent = start_agent(state, preset="l40s", extra=extra)
        try:
            reply = agent.request("PUT", "/v1/claims/mps", {"devices": [
                {"kind": "gpu", "device": "2", "sharing": MPS_50}]})
            assert reply.status == 200, reply.body
            wait_for(lambda: _claim(agent, "mps")["mps"]["state"] == "running",
                     "the MPS daemon to run", 30, every_s=0.05)
            daemons = agent.request("GET", "/v1/sim").body["mps_daemons"]
        finally:
            agent.stop(signal.SIGTERM)
        agent = start_agent(state, preset="l40s", extra=extra)
        try:
            claim = _claim(agent, "mps")
            assert claim["state"] == "prepare_completed", claim
            assert claim["mps"]["state"] == "running", claim
            assert [d["pid"] for d in agent.request("GET", "/v1/sim").body["mps_daemons"]] == \
                [d["pid"] for d in daemons]  # adopted, not restarted
            assert agent.request("DELETE", "/v1/claims/mps").status == 204
        finally:
            agent.stop(signal.SIGKILL)


def test_driver_reload_while_down_reapplies_and_hand_change_is_reported(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = state / "proc"
    with SimulatedNode("dgx-h100", state, proc) as sim:
        for gpu in sim.hardware.state.gpus:  # a driver loaded long ago
            gpu.energy_mj = 10**12
        sim.hardware.commit()
    extra: list[str] = []
    agent = start_agent(state, extra=extra)
    try:
        _apply(agent, "1")
        _apply(agent, "2")
        mig = agent.request("GET", "/v1/gpus/2/mig", token=None).body["instances"]
        gi = next(i["gi_id"] for i in mig if i["profile"] == "3g.40gb")
        for uid, device in (("whole", "3"), ("mig", f"2:{gi}")):
            reply = agent.request("PUT", f"/v1/claims/{uid}",
                                  {"devices": [{"kind": "gpu", "device": device}]})
            assert reply.status == 200, reply.body
    finally:
        agent.stop(signal.SIGTERM)
    with SimulatedNode("dgx-h100", state, proc) as sim:
        boot = sim.boot_id
        sim.reload_driver()
        assert sim.boot_id == boot
    agent = start_agent(state, extra=extra)
    try:
        _settled(agent, "1", BALANCED)  # re-applied after the reload
        _settled(agent, "2", BALANCED)
        assert agent.request("GET", "/v1/gpus/1/mig", token=None).body["drift"] is None
        assert _claim(agent, "whole")["state"] == "prepare_completed"
        lost = _claim(agent, "mig")
        assert lost["state"] == "lost" and "vanished" in lost["lost_reason"], lost
    finally:
        agent.stop(signal.SIGTERM)
    # The same driver load: a GPU emptied by hand is reported, not re-applied.
    with SimulatedNode("dgx-h100", state, proc) as sim:
        sim.reset_gpu(sim.gpu_uuids()[1])
    agent = start_agent(state, extra=extra)
    try:
        assert _layout(agent, "1") == []
        assert "left as it is" in agent.request("GET", "/v1/gpus/1/mig", token=None
                                                ).body["drift"]
    finally:
        agent.stop(signal.SIGKILL)


def _rewrite_checkpoint(path: Path, change: Any) -> None:
    payload = json.loads(path.read_bytes().partition(b"\n")[2])
    change(payload)
    newer = type(CHECKPOINT)(CHECKPOINT.format, CHECKPOINT.version + 1)
    path.write_bytes(encode_envelope(newer, json.dumps(payload).encode()))


def test_newer_checkpoint_is_read_for_what_this_agent_knows(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        assert agent.request("PUT", "/v1/claims/c1", {"devices": [
            {"kind": "gpu", "device": "0"}]}).status == 200
    finally:
        agent.stop(signal.SIGTERM)

    def add_fields(payload: dict[str, Any]) -> None:
        payload["schema_version"] += 1
        payload["from_the_future"] = {"x": 1}
        payload["claims"]["c1"]["from_the_future"] = True
    _rewrite_checkpoint(state / "claims.checkpoint", add_fields)
    agent = start_agent(state)
    try:
        assert _claim(agent, "c1")["state"] == "prepare_completed"
        assert "checkpoint written by a newer agent" in agent.log() or \
            "file written by a newer agent" in agent.log()
    finally:
        agent.stop(signal.SIGTERM)

    def new_state(payload: dict[str, Any]) -> None:
        payload["claims"]["c1"]["state"] = "a_state_from_the_future"
    _rewrite_checkpoint(state / "claims.checkpoint", new_state)
    agent = start_agent(state, wait_ready=False)
    try:
        def frozen() -> dict[str, Any] | None:
            reply = agent.request("GET", "/readyz", unix=True, token=None)
            body: dict[str, Any] = reply.body
            return body if reply.status == 503 and "an operator must act" in json.dumps(body) \
                else None
        wait_for(frozen, "claims frozen", 30, every_s=0.05)
        assert agent.request("GET", "/v1/claims/c1", token=None).status == 503
        assert list(state.glob("claims.checkpoint.corrupt-*"))  # kept, never replaced
    finally:
        agent.stop(signal.SIGKILL)
