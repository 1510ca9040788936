"""A simulated GB200 NVL72 tray put in an NVLink domain by its flags: ``/v1/gpus`` and
``gpu-agent gpus`` show the fabric, and a fabric fault shows at the next read; a GPU whose
fabric is not registered is published tainted and without its clique, and claims, events and
metrics treat it as unavailable until the fabric is back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, start_agent
from tests.integration.owner_steps import gpu_request, prepare, problem
from tests.integration.test_cli import cli
from tests.waiting import wait_for

CLUSTER = "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"
CLIQUE = f"{CLUSTER}.7"


def test_a_tray_in_a_domain_shows_its_fabric_and_a_fault_flips_it(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "tray", preset="gb200-nvl72",
                        extra=["--sim-cluster-uuid", CLUSTER, "--sim-clique-id", "7"])
    try:
        gpus = agent.request("GET", "/v1/gpus", token=None).body["gpus"]
        assert [g["name"] for g in gpus] == ["NVIDIA GB200"] * 4
        assert [g["fabric"] for g in gpus] == [{
            "state": "completed", "status": "NVML_SUCCESS", "cluster_uuid": CLUSTER,
            "clique_id": 7, "clique": CLIQUE, "health_mask": 0x1AA, "health": []}] * 4

        wide = cli("gpus", "-o", "wide", "--url", agent.url)
        assert wide.returncode == 0, wide.stderr
        header, *rows = wide.stdout.splitlines()[:5]
        assert "FABRIC" in header.split() and "CLIQUE" in header.split()
        assert all(f" completed  {CLIQUE} " in row for row in rows), wide.stdout
        listed = json.loads(cli("gpus", "--json", "--url", agent.url).stdout)
        assert [g["fabric"]["clique"] for g in listed["gpus"]] == [CLIQUE] * 4

        flipped = cli("sim", "--url", agent.url, "--token-file", str(agent.state_dir / "tokens"),
                      "fabric", "1", "in-progress")
        assert flipped.returncode == 0, flipped.stderr
        gpu = agent.request("GET", "/v1/gpus/1", token=None).body
        assert gpu["fabric"]["state"] == "in_progress"
        assert (gpu["fabric"]["cluster_uuid"], gpu["fabric"]["clique"]) == (None, None)
        assert gpu["health"] == {"healthy": False,
                                 "reasons": ["NVLink fabric not registered: in_progress"]}
        detail = cli("gpus", "1", "--url", agent.url).stdout
        assert any(line.split() == ["fabric", "in_progress"] for line in detail.splitlines())
        others = agent.request("GET", "/v1/gpus", token=None).body["gpus"]
        assert [g["fabric"]["clique"] for g in others] == [CLIQUE, None, CLIQUE, CLIQUE]

        degraded = agent.request("POST", "/v1/sim/fabric", {"gpu": "2", "condition": "degraded"})
        assert degraded.status == 204, degraded.body
        assert agent.request("GET", "/v1/gpus/2", token=None).body["fabric"]["health"] == [
            "degraded_bandwidth"]
        bad = agent.request("POST", "/v1/sim/fabric", {"gpu": "2", "condition": "lost"})
        assert bad.status == 422
        assert agent.request("GET", "/v1/gpus/2", token=None).body["fabric"]["health"] == [
            "degraded_bandwidth"]  # a refused fault changes nothing
    finally:
        agent.stop(signal.SIGKILL)


def _published(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    """Each published device by name: its fabricClique and its taints (key, value, effect)."""
    body = agent.request("GET", "/v1/resourceslices", token=None).body
    return {d["name"]: {"clique": (d["attributes"].get("fabricClique") or {}).get("string"),
                        "taints": [(t["key"], t.get("value"), t["effect"])
                                   for t in d.get("taints", [])]}
            for item in body["items"] for d in item["spec"].get("devices", [])}


def _taint_events(agent: AgentProcess, verb: str) -> list[dict[str, Any]]:
    events = agent.request("GET", "/v1/events").body["events"]
    return [e for e in events if e["kind"] == f"gpu.taint_{verb}"
            and e["details"]["key"] == "gpu.nodeagent.dev/fabric"]


def test_a_gpu_whose_fabric_is_not_registered_is_not_offered_until_it_is(
        tmp_path: Path) -> None:
    """GPU 1's fabric in progress: its device loses fabricClique and carries a fabric
    NoSchedule taint, a claim on it is refused naming the fabric, an event and the
    availability gauge say so, the node's compute-domain slot is withdrawn; the other GPUs
    are unchanged. Completed again: all as before, the slot included."""
    agent = start_agent(tmp_path / "tray", preset="gb200-nvl72",
                        extra=["--sim-cluster-uuid", CLUSTER, "--sim-clique-id", "7",
                               "--collect-interval", "0.2"])
    try:
        healthy = {**{f"gpu-{i}": {"clique": CLIQUE, "taints": []} for i in range(4)},
                   "slot": {"clique": CLIQUE, "taints": []}}
        assert _published(agent) == healthy

        flipped = cli("sim", "--url", agent.url, "--token-file", str(agent.state_dir / "tokens"),
                      "fabric", "1", "in-progress")
        assert flipped.returncode == 0, flipped.stderr
        without_slot = {name: seen for name, seen in healthy.items() if name != "slot"}
        assert _published(agent) == {**without_slot, "gpu-1": {
            "clique": None, "taints": [("gpu.nodeagent.dev/fabric", "in_progress", "NoSchedule")]}}
        topology = agent.request("GET", "/v1/topology", token=None).body["gpus"]
        assert [g["fabric_clique"] for g in topology] == [CLIQUE, None, CLIQUE, CLIQUE]
        assert "NVLink fabric not registered" in topology[1]["unavailable"]
        refused = prepare(agent, "on-gpu-1", gpu_request("1"))
        assert (refused.status, problem(refused)) == (409, "device-unavailable")
        assert "NVLink fabric not registered: in_progress" in refused.body["detail"]
        assert prepare(agent, "on-gpu-2", gpu_request("2")).status in (200, 201)
        (added,) = wait_for(lambda: _taint_events(agent, "added"), "the fabric taint's event")
        assert (added["gpu"], added["details"]["value"]) == (
            agent.request("GET", "/v1/gpus/1", token=None).body["uuid"], "in_progress")
        wait_for(lambda: _available(agent, "1") == "0", "GPU 1 to read unavailable")
        assert [_available(agent, i) for i in "023"] == ["1"] * 3

        back = agent.request("POST", "/v1/sim/fabric", {"gpu": "1", "condition": "completed"})
        assert back.status == 204, back.body
        assert _published(agent) == healthy
        topology = agent.request("GET", "/v1/topology", token=None).body["gpus"]
        assert [g["fabric_clique"] for g in topology] == [CLIQUE] * 4
        assert topology[1]["unavailable"] is None
        wait_for(lambda: _taint_events(agent, "removed"), "the fabric taint to go")
        wait_for(lambda: _available(agent, "1") == "1", "GPU 1 to read available")
        assert prepare(agent, "on-gpu-1", gpu_request("1")).status in (200, 201)
    finally:
        agent.stop(signal.SIGKILL)


def _available(agent: AgentProcess, index: str) -> str | None:
    """The value of ``gpu_agent_gpu_available`` for GPU ``index``."""
    text = agent.request("GET", "/metrics", token=None).body
    for line in text.splitlines():
        if line.startswith("gpu_agent_gpu_available{") and f'gpu="{index}"}}' in line:
            return line.rsplit(" ", 1)[1].removesuffix(".0")
    return None


def test_a_preset_without_fabric_refuses_domain_flags_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agent", "serve", "--simulate", "l40s",
                          "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                          "--sim-clique-id", "3"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no NVLink fabric" in lines[0], out.stderr
