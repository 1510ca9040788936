"""mig-parted semantics through a real agent process: GPUs without MIG skipped, indices the node
lacks ignored, the dry run, the reset opt-in of a node-wide apply, and the export of a node
without MIG."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.mig.parted_export import standard_configs
from tests.agent_process import AgentProcess, start_agent
from tests.integration.test_mig import apply_ended, mutations
from tests.mig.catalogs import A100_40GB, H100_80GB
from tests.mig.test_parted_config import NODE_CONFIG
from tests.waiting import wait_for

A100_BALANCED = {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}


def cli(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args, "--url", agent.url,
                           "--token-file", str(agent.state_dir / "tokens")],
                          capture_output=True, text=True, timeout=120, check=False)


def apply(agent: AgentProcess, label: str, config: str = NODE_CONFIG, query: str = "",
          **extra: Any) -> Any:
    return agent.request("POST", f"/v1/mig/apply{query}",
                         {"config": config, "label": label, **extra})


def finished(agent: AgentProcess, reply: Any, timeout: float = 60) -> dict[str, Any]:
    """The apply behind ``reply`` once no GPU's transition is running any more."""
    assert reply.status == 202, reply.body
    return wait_for(partial(apply_ended, agent, reply.headers["location"]), "the apply to end",
                    timeout, every_s=0.05)


def one_label(label: str, entries: list[dict[str, Any]]) -> str:
    return yaml.safe_dump({"version": "v1", "mig-configs": {label: entries}})


@pytest.fixture
def l40s(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path / "l40s", preset="l40s")
    yield agent
    agent.stop(signal.SIGKILL)


@pytest.fixture
def h100(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path / "h100")
    yield agent
    agent.stop(signal.SIGKILL)


def test_every_cluster_wide_label_works_on_an_l40s_node(l40s: AgentProcess) -> None:
    """On a node without MIG, the GPU Operator's default label and every generate-config label
    answer a plan that skips each GPU, saying why, and never an empty list of profiles."""
    for catalog in (H100_80GB, A100_40GB):
        text = yaml.safe_dump(standard_configs(catalog))
        for label in yaml.safe_load(text)["mig-configs"]:
            reply = apply(l40s, label, text, "?dry_run=true")
            assert reply.status == 200, (label, reply.body)
            assert reply.body["transitions"] == [], label
            assert [s["index"] for s in reply.body["skipped"]] == [0, 1, 2, 3], label
            assert "offers ;" not in json.dumps(reply.body)
    done = finished(l40s, apply(l40s, "all-disabled"))
    assert done["state"] == "succeeded"
    assert done["skipped"][0]["reason"] == "NVIDIA L40S: no MIG; skipped under devices: all"
    again = l40s.request("GET", f"/v1/mig/apply/{done['apply_id']}", token=None).body
    assert again["skipped"] == done["skipped"]
    assert mutations(l40s) == 0


def test_mig_on_by_index_on_an_l40s_is_a_422_and_changes_nothing(l40s: AgentProcess) -> None:
    """An index listed with mig-enabled true on a GPU without MIG is refused in mig-parted's
    words, naming the entry and the GPU; nothing is applied on the others."""
    reply = apply(l40s, "first-two-3g")
    assert reply.status == 422
    assert reply.content_type == "application/problem+json"
    assert "cannot set MIG mode on non MIG-capable GPU" in reply.body["detail"]
    assert [(e["field"], e["gpu"]) for e in reply.body["errors"]] == [
        ("mig-configs.first-two-3g[0].devices", 0), ("mig-configs.first-two-3g[0].devices", 1)]
    assert l40s.request("GET", "/v1/transitions", token=None).body["transitions"] == []


def test_indices_the_node_lacks_are_ignored_and_listed(l40s: AgentProcess,
                                                       h100: AgentProcess) -> None:
    """``devices: [0, 8]`` applies to GPU 0 and lists 8 in ``missing_indices``."""
    done = finished(l40s, apply(l40s, "zero-and-eight-off"))
    assert (done["state"], done["missing_indices"]) == ("succeeded", [8])
    assert [s["index"] for s in done["skipped"]] == [0]
    text = one_label("x", [{"devices": [0, 8], "mig-enabled": True,
                            "mig-devices": {"7g.80gb": 1}}])
    done = finished(h100, apply(h100, "x", text))
    assert done["state"] == "succeeded"
    assert done["missing_indices"] == [8]
    assert [(t["index"], t["state"]) for t in done["transitions"]] == [(0, "succeeded")]
    cli_out = cli(h100, "mig", "apply", "-f", _write(h100, text), "-c", "x", "--dry-run")
    assert cli_out.returncode == 0, cli_out.stderr
    assert "GPU 8 not on this node: ignored" in cli_out.stdout


def _write(agent: AgentProcess, text: str) -> str:
    path = agent.state_dir.parent / f"{agent.state_dir.name}-config.yaml"
    path.write_text(text)
    return str(path)


def test_dry_run_returns_every_plan_and_changes_nothing(h100: AgentProcess) -> None:
    """``?dry_run=true`` answers 200 with each selected GPU's plan (and what would block it
    now, instead of a 409), keeps no apply and makes no NVML mutation; so does the CLI."""
    reply = apply(h100, "all-balanced", query="?dry_run=true")
    assert reply.status == 200, reply.body
    body = reply.body
    assert (body["dry_run"], body["state"], body["apply_id"]) == (True, "planned", None)
    assert [t["index"] for t in body["transitions"]] == list(range(8))
    for row in body["transitions"]:
        assert (row["state"], row["id"]) == ("planned", None)
        assert row["plan"]["summary"].startswith("enable MIG, keep 0, destroy 0, create 4")
    assert mutations(h100) == 0
    assert h100.request("GET", "/v1/transitions", token=None).body["transitions"] == []

    done = finished(h100, apply(h100, "first-two-3g"))
    assert done["state"] == "succeeded"
    device = h100.request("GET", "/v1/gpus/0", token=None).body["mig_devices"][0]
    h100.request("POST", "/v1/sim/processes", {"device": device["uuid"], "pid": 4321})
    before = mutations(h100)
    assert apply(h100, "all-disabled").status == 409  # drain policy fail, for real
    dry = apply(h100, "all-disabled", query="?dry_run=true").body
    rows = {t["index"]: t for t in dry["transitions"]}
    assert (rows[0]["state"], rows[2]["state"]) == ("planned", "unchanged")
    assert rows[0]["blockers"] == [{"instance": f"{device['profile']}@"
                                                f"{device['placement']['start']}:"
                                                f"{device['placement']['size']}",
                                    "kind": "process", "id": "4321"}]
    assert rows[2]["blockers"] == []
    out = cli(h100, "mig", "apply", "-f", _write(h100, NODE_CONFIG), "-c", "first-two-3g",
              "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "(dry run, nothing changed)" in out.stdout
    assert [line.split()[2] for line in out.stdout.splitlines()[2:4]] == ["unchanged"] * 2
    assert mutations(h100) == before
    assert apply(h100, "x", query="?dry_run=maybe").status == 422


def test_export_of_a_node_without_mig(l40s: AgentProcess) -> None:
    """Every GPU exports as ``mig-enabled: false`` (``devices: all``), through the API and the
    CLI, and the export applies back as it is."""
    want = {"version": "v1", "mig-configs": {"current": [
        {"devices": "all", "mig-enabled": False}]}}
    reply = l40s.request("GET", "/v1/mig/export", token=None)
    assert (reply.status, reply.body) == (200, want)
    out = cli(l40s, "mig", "export")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == want
    assert finished(l40s, apply(l40s, "current", out.stdout))["state"] == "succeeded"


def test_export_lists_every_gpu_of_a_mig_node(h100: AgentProcess) -> None:
    """On an H100 node the export groups the GPUs by layout and applies back unchanged."""
    finished(h100, apply(h100, "first-two-3g"))
    config = h100.request("GET", "/v1/mig/export", token=None).body
    assert config["mig-configs"]["current"] == [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
        {"devices": [2, 3, 4, 5, 6, 7], "mig-enabled": False}]
    before = mutations(h100)
    done = finished(h100, apply(h100, "current", yaml.safe_dump(config)))
    assert {t["state"] for t in done["transitions"]} == {"unchanged"}
    assert mutations(h100) == before


# --- the reset opt-in on Ampere ---------------------------------------------------------------


@pytest.fixture
def a100(tmp_path: Path) -> Iterator[tuple[AgentProcess, Path]]:
    """A DGX A100 agent whose --gpu-reset-command is a script that logs the GPU it resets and
    then resets it through the simulator; the agent and the log."""
    state = tmp_path / "state"
    log = tmp_path / "resets.log"
    script = tmp_path / "reset-gpu"
    script.write_text(f"#!/bin/sh\necho \"$1\" >> {log}\nexec {sys.executable} -m agent sim "
                      f"--url unix:{state / 'agent.sock'} --token-file {state / 'tokens'} "
                      "reset \"$1\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    log.touch()
    agent = start_agent(state, preset="dgx-a100",
                        extra=["--gpu-reset-command", f"{script} {{uuid}}"])
    yield agent, log
    agent.stop(signal.SIGKILL)


def _uuids(agent: AgentProcess, *indices: int) -> list[str]:
    return [agent.request("GET", f"/v1/gpus/{i}", token=None).body["uuid"] for i in indices]


def test_allow_reset_finishes_an_ampere_apply_in_one_step(
        a100: tuple[AgentProcess, Path]) -> None:
    """Without the opt-in an Ampere mode change ends pending_reset (CLI exit 1) and nothing is
    reset; with ``--allow-reset`` the agent resets each GPU and the apply succeeds."""
    agent, log = a100
    path = _write(agent, one_label("pair", [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": A100_BALANCED}]))
    refused = cli(agent, "mig", "apply", "-f", path, "-c", "pair", "--wait")
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout.count("pending_reset") >= 2
    assert "allow_reset" in refused.stdout
    assert log.read_text() == ""
    allowed = cli(agent, "mig", "apply", "-f", path, "-c", "pair", "--wait", "--allow-reset")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert sorted(log.read_text().split()) == sorted(_uuids(agent, 0, 1))
    for gpu in ("0", "1"):
        geometry = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
        assert geometry["mig_mode"] == {"current": True, "pending": True}
        assert len(geometry["instances"]) == 4


def test_allow_reset_never_resets_a_gpu_a_claim_holds(a100: tuple[AgentProcess, Path]) -> None:
    """A claim on GPU 2 blocks its mode change (409 under fail; aborted under wait) and its
    reset; GPU 3 of the same apply is reset and succeeds."""
    agent, log = a100
    held, free = _uuids(agent, 2, 3)
    claim = agent.request("PUT", "/v1/claims/held-gpu",
                          {"devices": [{"kind": "gpu", "device": held}]})
    assert claim.status in (200, 201), claim.body
    text = one_label("pair", [{"devices": [2, 3], "mig-enabled": True,
                               "mig-devices": A100_BALANCED}])
    refused = apply(agent, "pair", text, allow_reset=True)
    assert refused.status == 409 and "held-gpu" in refused.body["detail"]
    done = finished(agent, apply(agent, "pair", text, allow_reset=True,
                                 drain={"policy": "wait", "timeout_s": 0.5}))
    states = {t["index"]: t["state"] for t in done["transitions"]}
    assert states == {2: "aborted", 3: "succeeded"}, done
    assert log.read_text().split() == [free]
    assert agent.request("GET", "/v1/gpus/2/mig", token=None).body["mig_mode"]["current"] \
        is False
