"""Remediation for operators against a real agent: quarantine, open journal entries, a corrupt
claims checkpoint, the support bundle; every action needs the admin scope and is audited."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for


def _cli(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args, "--url", agent.url,
                           "--token-file", str(agent.state_dir / "tokens")],
                          capture_output=True, text=True, timeout=60, check=False)


def _quarantine(state: Path, gpu: str) -> None:
    path = state / "mig" / "quarantine.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "items": {
        gpu: {"reason": "rollback of transition t1 failed: test", "since": time.time()}}}))


def _open_entry(agent: AgentProcess, index: int) -> str:
    """Write an open journal entry whose target is what the GPU shows (as if the agent had
    died between the last step and closing the entry)."""
    doc = agent.request("GET", f"/v1/gpus/{index}/mig").body
    instances = [{"profile": i["profile"], "placement": i["placement"], "gi_id": i["gi_id"]}
                 for i in doc["instances"]]
    enabled = bool(doc["mig_mode"]["current"])
    old = {"mig_enabled": enabled, "instances": instances}
    payload: dict[str, Any] = {
        "schema_version": 1, "transition_id": f"hand{index}", "gpu": doc["gpu"], "old": old,
        "old_ci_profiles": {}, "plan": {"mig_enabled_before": enabled,
                                        "mig_enabled_after": enabled, "keep": instances,
                                        "destroy": [], "create": []},
        "phase": "applying", "next_step": None, "done": [], "started_at": time.time()}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    journal = agent.state_dir / "mig" / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    (journal / f"{doc['gpu']}.json").write_text(json.dumps({"sha256": digest, "entry": payload}))
    return str(doc["gpu"])


def test_clear_quarantine_and_resolve_by_hand(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    gpu0 = agent.request("GET", "/v1/gpus/0").body["uuid"]
    agent.stop()
    _quarantine(state, gpu0)
    agent = start_agent(state)
    try:
        assert agent.request("GET", "/v1/gpus/0/mig").body["quarantined"]
        assert agent.request("POST", "/v1/admin/gpus/0/clear-quarantine",
                             token=None).status == 401
        done = _cli(agent, "admin", "clear-quarantine", "0")
        assert done.returncode == 0, done.stderr
        assert "rollback of transition t1" in json.loads(done.stdout)["was"]
        assert agent.request("GET", "/v1/gpus/0/mig").body["quarantined"] is None
        again = agent.request("POST", "/v1/admin/gpus/0/clear-quarantine")
        assert again.status == 409

        nothing = agent.request("POST", "/v1/admin/transitions/1/resolve", {"action": "finish"})
        assert nothing.status == 404 and "no open journal entry" in nothing.body["detail"]
        assert agent.request("POST", "/v1/admin/transitions/1/resolve",
                             {"action": "sideways"}).status == 422
        _open_entry(agent, 1)
        finished = agent.request("POST", "/v1/admin/transitions/1/resolve", {"action": "finish"})
        assert finished.status == 200, finished.body
        assert finished.body["state"] == "succeeded"
        _open_entry(agent, 2)
        done = _cli(agent, "admin", "resolve", "2", "roll-back")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["state"] == "rolled_back"
        assert not list((state / "mig" / "journal").glob("*.json"))
        kinds = {e["kind"] for e in agent.request("GET", "/v1/events").body["events"]}
        assert "mig.quarantine_cleared" in kinds
        # (The simulated agent prints its generated token once at start; logs never carry it.)
        log = [line for line in agent.log().splitlines() if line.startswith("ts=")]
        assert any("logger=agent.audit" in line and "/v1/admin/gpus/0/clear-quarantine" in line
                   and "status=200" in line for line in log)
        assert agent.token is not None and not any(agent.token in line for line in log)
    finally:
        agent.stop(signal.SIGKILL)


def _corrupt_start(state: Path, good: bytes) -> AgentProcess:
    (state / "claims.checkpoint").write_bytes(good[:-40] + b"garbage")
    agent = start_agent(state, wait_ready=False)
    wait_for(lambda: "checkpoint" in str(agent.request("GET", "/readyz", token=None).body),
             "/readyz to name the checkpoint", 30, every_s=0.05)
    return agent


def test_corrupt_checkpoint_restored_or_accepted_without_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    agent.stop()
    good = (state / "claims.checkpoint").read_bytes()

    agent = _corrupt_start(state, good)
    try:
        status = agent.request("GET", "/v1/admin/claims-checkpoint").body
        assert status["corrupt"] and not status["ready"]
        kept = status["kept"][-1]
        frozen = agent.request("PUT", "/v1/claims/c1", {"devices": [
            {"kind": "slice", "profile": "1g.10gb"}]})
        assert frozen.status == 503, frozen.body
        still = agent.request("POST", "/v1/admin/claims-checkpoint",
                              {"action": "restore", "file": kept})
        assert still.status == 409 and "still fails its check" in still.body["detail"]
        assert agent.request("POST", "/v1/admin/claims-checkpoint",
                             {"action": "restore", "file": "../tokens"}).status == 404
        done = _cli(agent, "admin", "checkpoint", "accept-empty")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"corrupt": None, "kept": [kept], "claims": 0,
                                           "ready": True}
        assert agent.request("GET", "/readyz", token=None).status == 200
        assert agent.request("POST", "/v1/admin/claims-checkpoint",
                             {"action": "accept-empty"}).status == 409
    finally:
        agent.stop()

    earlier = kept
    agent = _corrupt_start(state, good)
    try:
        # Kept aside again, beside the first (the same second gets a serial, never a clash).
        [kept] = [k for k in agent.request("GET", "/v1/admin/claims-checkpoint").body["kept"]
                  if k != earlier]
        (state / kept).write_bytes(good)  # the operator repaired it by hand
        restored = agent.request("POST", "/v1/admin/claims-checkpoint",
                                 {"action": "restore", "file": kept})
        assert restored.status == 200, restored.body
        assert restored.body["ready"] is True
        assert agent.request("GET", "/readyz", token=None).status == 200
    finally:
        agent.stop(signal.SIGKILL)


def test_support_bundle_has_everything_and_no_secret(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state")
    try:
        log_file = tmp_path / "agent.log"
        log_file.write_text(f"level=info msg=x\nAuthorization: Bearer {agent.token}\n"
                            "token=abc123 other=1\n")
        out = tmp_path / "bundle.tar.gz"
        done = _cli(agent, "support-bundle", "-f", str(out), "--log-file", str(log_file))
        assert done.returncode == 0, done.stderr
        assert "deprecated" not in done.stderr
        with tarfile.open(out) as archive:
            names = set(archive.getnames())
            texts = {m.name: archive.extractfile(m).read().decode()  # type: ignore[union-attr]
                     for m in archive.getmembers() if m.isfile()}
        for member in ("versions.json", "node.json", "gpus.json", "mig/gpu0.json",
                       "transitions.json", "claims.json", "events.json", "metrics.txt",
                       "agent.log", "claims-checkpoint.json"):
            assert f"gpu-agent-support/{member}" in names
        assert "DCGM_FI_DEV_GPU_TEMP" in texts["gpu-agent-support/metrics.txt"]
        assert agent.token is not None
        for text in texts.values():
            assert agent.token not in text
            assert "abc123" not in text
        assert "Authorization: <redacted>" in texts["gpu-agent-support/agent.log"]
    finally:
        agent.stop(signal.SIGKILL)


def test_support_bundle_dash_o_still_writes_the_archive_and_says_it_is_deprecated(
        h100: AgentProcess, tmp_path: Path) -> None:
    """``support-bundle -o FILE`` (before ``-f/--file``) works for one more release: the same
    archive, and one line on stderr naming the new flag."""
    out = tmp_path / "old.tar.gz"
    done = _cli(h100, "support-bundle", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    with tarfile.open(out) as archive:
        assert "gpu-agent-support/node.json" in archive.getnames()
    warned = [line for line in done.stderr.splitlines() if "deprecated" in line]
    assert warned == ["gpu-agent: support-bundle -o FILE is deprecated; use -f/--file FILE"]
    both = _cli(h100, "support-bundle", "-o", str(out), "-f", str(out))
    assert both.returncode == 2 and "not allowed with" in both.stderr
