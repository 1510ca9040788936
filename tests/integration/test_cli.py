"""The ``gpu-agent`` client verbs against a real agent process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.agent_process import AgentProcess


def cli(*args: str, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True,
                          timeout=60, check=False, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def test_gpus_table_and_json(h100: AgentProcess) -> None:
    table = cli("gpus", "--url", h100.url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["IDX", "NAME", "MEMORY"]
    assert len(lines) == 9
    assert all("H100 80GB HBM3" in line and len(line) <= 120 for line in lines[1:])
    wide = cli("gpus", "-o", "wide", "--url", h100.url).stdout.splitlines()
    assert wide[0].split()[:3] == ["IDX", "NAME", "UUID"]
    assert all("NVIDIA H100 80GB HBM3" in line for line in wide[1:9])
    as_json = json.loads(cli("gpus", "--json", "--url", f"unix:{h100.socket_path}").stdout)
    assert len(as_json["gpus"]) == 8


def test_node(h100: AgentProcess) -> None:
    out = cli("node", "--url", h100.url)
    assert out.returncode == 0
    assert "simulated:dgx-h100" in out.stdout


def test_sim_verbs_use_the_token_file(h100: AgentProcess) -> None:
    tokens = str(h100.state_dir / "tokens")
    uuid = h100.request("GET", "/v1/gpus/4", token=None).body["uuid"]
    added = cli("sim", "--url", h100.url, "--token-file", tokens, "process", "add", uuid,
                "--pid", "777", "--memory-mib", "512")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["pid"] == 777
    shown = json.loads(cli("sim", "--url", h100.url, "--token-file", tokens, "show").stdout)
    assert [p["pid"] for p in shown["processes"]] == [777]
    assert cli("sim", "--url", h100.url, "--token-file", tokens, "process", "rm",
               "777").returncode == 0
    no_token = cli("sim", "--url", h100.url, "process", "rm", "777")
    assert no_token.returncode == 4  # the credentials kind
    assert "401" in no_token.stderr


def test_sim_xid_takes_a_recovery_action(h100: AgentProcess) -> None:
    """``sim xid --recovery-action`` sets the GPU's NVML recovery action; a name it does not
    know is a usage error; ``sim reset`` sets it back to none (the GPU is left as found)."""
    sim = ("sim", "--url", h100.url, "--token-file", str(h100.state_dir / "tokens"))
    out = cli(*sim, "xid", "6", "31", "--recovery-action", "drain-and-reset")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"gpu": "6", "xid": 31, "recovery_action": "drain-and-reset"}
    assert json.loads(cli(*sim, "show").stdout)["gpus"][6]["recovery_action"] == \
        "drain-and-reset"
    bad = cli(*sim, "xid", "6", "31", "--recovery-action", "explode")
    assert bad.returncode == 2 and "--recovery-action" in bad.stderr
    assert cli(*sim, "reset", "6").returncode == 0
    assert json.loads(cli(*sim, "show").stdout)["gpus"][6]["recovery_action"] == "none"


def test_unreachable_agent_is_one_clear_line(tmp_path: Path) -> None:
    out = cli("gpus", "--url", f"unix:{tmp_path / 'nothing.sock'}")
    assert out.returncode == 3  # the unreachable kind
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("gpu-agent: cannot reach the agent at unix:")
    out = cli("node", "--url", "http://127.0.0.1:1")
    assert out.returncode == 3 and "cannot reach the agent" in out.stderr


def test_cli_finds_a_simulated_agent_started_from_the_same_directory(
        h100: AgentProcess, tmp_path: Path) -> None:
    # `make run` puts the state in ./.gpu-agent-sim; the CLI looks there first.
    link = tmp_path / ".gpu-agent-sim"
    link.symlink_to(h100.state_dir)
    out = cli("sim", "show", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["preset"] == "dgx-h100"
