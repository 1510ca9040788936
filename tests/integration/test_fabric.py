"""A simulated GB200 NVL72 tray put in an NVLink domain by its flags: ``/v1/gpus`` and
``gpu-agent gpus`` show the fabric, and a fabric fault shows at the next read."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.agent_process import start_agent
from tests.integration.test_cli import cli

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
        assert gpu["health"]["healthy"] is True
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


def test_a_preset_without_fabric_refuses_domain_flags_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agent", "serve", "--simulate", "l40s",
                          "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                          "--sim-clique-id", "3"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no NVLink fabric" in lines[0], out.stderr
