"""Claims through a real agent process: what DRA logic and a container runtime see."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import decode
from tests.agent_process import AgentProcess, Reply, start_agent
from tests.cdi.conftest import Checker
from tests.integration.owner_steps import wait_readyz, wait_transition
from tests.waiting import wait_for


def prepare(agent: AgentProcess, uid: str, devices: list[dict[str, Any]]) -> Reply:
    return agent.request("PUT", f"/v1/claims/{uid}", {"devices": devices})


def wait_mig(agent: AgentProcess, gpu: str, profiles: list[str]) -> None:
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": profiles})
    if reply.status == 202:
        location = reply.headers["location"]
        assert wait_transition(agent, location)["state"] == "succeeded"


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    running = start_agent(tmp_path / "state")
    yield running
    running.stop(signal.SIGKILL)


def test_full_gpu_and_mig_claims_pass_the_reference_library(agent: AgentProcess,
                                                             cdi_checker: Checker) -> None:
    full = prepare(agent, "claim-full", [{"kind": "gpu", "device": "gpu-2"}])
    assert full.status == 200, full.body
    wait_mig(agent, "5", ["3g.40gb"])
    sliced = prepare(agent, "claim-mig", [{"kind": "slice", "profile": "1g.10gb",
                                           "gpu": "5"}])
    assert sliced.status == 200, sliced.body
    cdi_dir = agent.state_dir / "cdi"
    names = full.body["devices"][0]["cdi_devices"] + sliced.body["devices"][0]["cdi_devices"]
    report = cdi_checker(cdi_dir, *names)
    assert report["errors"] == {} and report["exit"] == 0, report
    nodes = {(d["path"], d["major"], d["minor"]) for d in report["injected"]["linux"]["devices"]}
    assert ("/dev/nvidia2", 195, 2) in nodes and ("/dev/nvidia5", 195, 5) in nodes
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= {path for path, _, _ in nodes}
    assert "NVIDIA_VISIBLE_DEVICES=void" in report["injected"]["process"]["env"]
    # The MIG claim's two capability nodes carry the minors mig-minors lists for its GI/CI.
    minors = dict(line.split() for line in
                  (agent.state_dir / "proc/driver/nvidia-caps/mig-minors").read_text()
                  .splitlines())
    gpu5 = agent.request("GET", "/v1/gpus/5", token=None).body
    device = next(d for d in gpu5["mig_devices"]
                  if d["uuid"] == sliced.body["devices"][0]["uuid"])
    gi, ci = device["gi_id"], device["ci_id"]
    caps = {int(minors[f"gpu5/gi{gi}/access"]), int(minors[f"gpu5/gi{gi}/ci{ci}/access"])}
    assert {minor for path, _, minor in nodes if "nvidia-caps" in path} == caps
    # Every spec declares its minimum version; the node-wide spec names devices twice.
    for path in cdi_dir.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["cdiVersion"] in ("0.3.0", "0.5.0"), path
    specs = agent.request("GET", "/v1/cdi", token=None).body["specs"]
    node = next(s for s in specs if s["kind"] == "nodeagent.dev/gpu")
    assert {"nodeagent.dev/gpu=0", "nodeagent.dev/gpu=all", "nodeagent.dev/gpu=5:0"} <= set(
        node["devices"])


def test_two_concurrent_prepares_of_one_device(agent: AgentProcess) -> None:
    replies: list[Reply] = []

    def run(uid: str) -> None:
        replies.append(prepare(agent, uid, [{"kind": "gpu", "device": "1"}]))

    threads = [threading.Thread(target=run, args=(f"race-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in replies) == [200, 409]
    loser = next(r for r in replies if r.status == 409)
    assert loser.body["type"].endswith("/device-busy")
    assert "race-" in loser.body["detail"]


def _checkpoint_writes(agent: AgentProcess) -> float:
    metrics = agent.request("GET", "/metrics", token=None).body
    line = next(x for x in metrics.splitlines()
                if x.startswith("gpu_agent_claims_checkpoint_writes_total "))
    return float(line.split()[1])


def test_stale_retry_after_unprepare_is_refused(agent: AgentProcess) -> None:
    writes = _checkpoint_writes(agent)
    assert prepare(agent, "c1", [{"kind": "gpu", "device": "0"}]).status == 200
    assert agent.request("DELETE", "/v1/claims/c1").status == 204
    # One durable checkpoint write each, counted where an SRE can see them.
    assert _checkpoint_writes(agent) == writes + 2
    assert agent.request("DELETE", "/v1/claims/c1").status == 204
    late = prepare(agent, "c1", [{"kind": "gpu", "device": "0"}])
    assert late.status == 409
    assert late.body["type"].endswith("/claim-unprepared")
    assert agent.request("GET", "/v1/claims/c1", token=None).status == 404


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"devices": []}, 422, "devices"),
    ({"devices": [{"kind": "gpu"}]}, 422, "devices[0]"),
    ({"devices": [{"kind": "slice", "profile": "1g.10gb", "device": "x"}]}, 422, "devices[0]"),
    ({"devices": [{"kind": "gpu", "device": "nope"}]}, 422, "devices[0].device"),
    ({"devices": [{"kind": "gpu", "device": "0"}], "extra": 1}, 422, "extra"),
])
def test_bad_claims_are_4xx_and_change_nothing(agent: AgentProcess, body: dict[str, Any],
                                               status: int, field: str) -> None:
    reply = agent.request("PUT", "/v1/claims/bad", body)
    assert reply.status == status, reply.body
    assert reply.body["errors"][0]["field"] == field
    assert agent.request("GET", "/v1/claims", token=None).body["claims"] == []


def test_sigkill_in_a_burst_keeps_every_acknowledged_claim(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    wait_mig(agent, "6", [])
    wait_mig(agent, "7", [])
    agent.request("PUT", "/v1/sim/latency", {"nvmlDeviceCreateGpuInstanceWithPlacement": 0.05})
    acknowledged: dict[str, list[str]] = {}
    lock = threading.Lock()

    def client(n: int) -> None:
        for i in range(6):
            uid = f"b{n}-{i}"
            devices = [{"kind": "slice", "profile": "1g.10gb"}] if n % 2 else \
                [{"kind": "gpu", "device": str(n)}]
            try:
                reply = prepare(agent, uid, devices)
            except OSError:
                return  # killed mid-prepare: nothing was acknowledged
            if reply.status == 200:
                with lock:
                    acknowledged[uid] = reply.body["devices"][0]["cdi_devices"]
                if not n % 2:
                    # Once its unprepare is sent a claim is no longer promised: the kill may
                    # land before, during or after it (the checks below hold either way).
                    with lock:
                        acknowledged.pop(uid)
                    try:
                        agent.request("DELETE", f"/v1/claims/{uid}")
                    except OSError:
                        return  # killed mid-unprepare: its connection dies with the agent

    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    def a_kept_claim() -> bool:  # b<n>-<i>: odd clients ask for slices, and keep them
        with lock:
            return any(int(uid[1]) % 2 for uid in acknowledged)

    # Killed mid-burst, once a claim that stays has been acknowledged.
    wait_for(a_kept_claim, "a slice claim to be acknowledged", every_s=0.005)
    agent.stop(signal.SIGKILL)
    for t in threads:
        t.join()
    assert acknowledged, "the burst acknowledged nothing before the kill"
    again = start_agent(state)
    try:
        claims = {c["uid"]: c for c in again.request("GET", "/v1/claims", token=None)
                  .body["claims"]}
        for uid, names in acknowledged.items():
            assert uid in claims, f"acknowledged claim {uid} lost"
            assert claims[uid]["state"] == "prepare_completed", uid
            assert claims[uid]["devices"][0]["cdi_devices"] == names
            assert Path(claims[uid]["cdi_spec"]).exists()
        assert all(c["state"] == "prepare_completed" for c in claims.values())
        # Nothing half-made: every MIG device on the slice GPUs belongs to a claim.
        owned = {d["uuid"] for c in claims.values() for d in c["devices"]}
        for index in ("6", "7"):
            gpu = again.request("GET", f"/v1/gpus/{index}", token=None).body
            assert {d["uuid"] for d in gpu["mig_devices"]} <= owned
        spec_names = {p.name for p in (state / "cdi").glob("k8s.gpu.nodeagent.dev-claim_*")}
        assert spec_names == {f"k8s.gpu.nodeagent.dev-claim_{uid}.json" for uid in claims}
        on_disk = decode((state / "claims.checkpoint").read_bytes())
        assert set(on_disk.claims) == set(claims)
    finally:
        again.stop(signal.SIGKILL)


def test_corrupt_checkpoint_is_kept_reported_and_freezes_claims(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    assert prepare(agent, "c1", [{"kind": "gpu", "device": "0"}]).status == 200
    agent.stop()
    path = state / "claims.checkpoint"
    path.write_bytes(path.read_bytes()[:-20])  # torn
    agent = start_agent(state, wait_ready=False)
    try:
        ready = wait_readyz(agent, "checkpoint")
        assert ready.status == 503
        assert "kept aside" in ready.body["reason"]
        assert list(state.glob("claims.checkpoint.corrupt-*"))
        refused = prepare(agent, "c2", [{"kind": "gpu", "device": "1"}])
        assert refused.status == 503 and refused.body["type"].endswith("/checkpoint-corrupt")
        assert agent.request("GET", "/v1/gpus", token=None).status == 200
    finally:
        agent.stop()
