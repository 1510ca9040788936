"""An operator's first day against a real agent: quiet logs with one time form, events that
survive a restart and say when a cursor no longer fits, a forgiving and tidy CLI, simulator
controls by index, and XID marks an operator can clear."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One simulated DGX H100 agent logging JSON, with a metrics listener."""
    process = start_agent(tmp_path_factory.mktemp("first-day") / "state",
                          extra=["--log-format", "json", "--metrics-listen", "127.0.0.1:0"])
    yield process
    process.stop(signal.SIGKILL)


def _cli(agent: AgentProcess, *args: str,
         url: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args, "--url", url or agent.url,
                           "--token-file", str(agent.state_dir / "tokens")],
                          capture_output=True, text=True, timeout=60, check=False)


def _sim(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-agent sim`` takes its connection options before the verb."""
    return subprocess.run([sys.executable, "-m", "agent", "sim", "--url", agent.url,
                           "--token-file", str(agent.state_dir / "tokens"), *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _json_lines(agent: AgentProcess) -> list[dict[str, Any]]:
    lines = []
    for line in agent.log().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _poll(check: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    wait_for(check, what, timeout)


# -- logs --------------------------------------------------------------------------------------


def test_reads_log_at_debug_and_failures_and_mutations_at_info(agent: AgentProcess) -> None:
    """At the default level a successful GET writes no line, a failed GET writes an info
    access line, and a mutation its info audit line."""
    ok = agent.request("GET", "/v1/gpus", headers={"X-Request-Id": "read-ok"})
    missing = agent.request("GET", "/v1/gpus/99", headers={"X-Request-Id": "read-404"})
    changed = agent.request("DELETE", "/v1/sim/faults", headers={"X-Request-Id": "write-1"})
    assert (ok.status, missing.status, changed.status) == (200, 404, 204)
    by_id: dict[str, list[dict[str, Any]]] = {}
    _poll(lambda: "write-1" in {d.get("request_id") for d in _json_lines(agent)},
          "write-1's log line")
    for doc in _json_lines(agent):
        by_id.setdefault(str(doc.get("request_id")), []).append(doc)
    assert "read-ok" not in by_id
    assert [(d["logger"], d["level"], d["status"]) for d in by_id["read-404"]] == [
        ("agent.access", "info", 404)]
    assert [(d["logger"], d["level"]) for d in by_id["write-1"]] == [("agent.audit", "info")]


def test_log_and_event_times_are_one_iso_8601_form(agent: AgentProcess, tmp_path: Path) -> None:
    """JSON log lines, text log lines and events all give times as ISO 8601 UTC with
    milliseconds."""
    assert all(ISO.match(doc["ts"]) for doc in _json_lines(agent))
    events = agent.request("GET", "/v1/events").body["events"]
    assert events and all(ISO.match(e["time"]) for e in events)
    text = start_agent(tmp_path / "text", extra=["--log-format", "text"])
    try:
        stamps = [line.split(" ", 1)[0] for line in text.log().splitlines()
                  if line.startswith("ts=")]
        assert stamps and all(ISO.match(s.removeprefix("ts=")) for s in stamps)
    finally:
        text.stop(signal.SIGKILL)


def test_listening_line_names_the_metrics_listener(agent: AgentProcess) -> None:
    """The start-up "listening" line names every listener, the metrics one included."""
    [line] = [d for d in _json_lines(agent) if d["msg"] == "listening"]
    assert agent.listener("metrics") in line["metrics"]
    assert agent.url.split("://")[1] in line["listeners"]


def test_claim_events_carry_their_gpus(agent: AgentProcess) -> None:
    """A claim's prepared and unprepared events name the GPU they hold, in the event and its
    log line, never ``gpu=-``."""
    uuid = agent.request("GET", "/v1/gpus/3").body["uuid"]
    done = agent.request("PUT", "/v1/claims/first-day", {"devices": [
        {"kind": "gpu", "device": "gpu-3"}]})
    assert done.status == 200, done.body
    assert agent.request("DELETE", "/v1/claims/first-day").status == 204
    events = [e for e in agent.request("GET", "/v1/events").body["events"]
              if e["details"].get("claim") == "first-day"]
    assert [(e["kind"], e["details"]["gpus"]) for e in events] == [
        ("claim.prepared", [uuid]), ("claim.unprepared", [uuid])]
    _poll(lambda: len([d for d in _json_lines(agent)
                       if str(d.get("event", "")).startswith("claim.")
                       and "first-day" in d["msg"]]) == 2, "both claim events logged")
    logged = [d for d in _json_lines(agent)
              if str(d.get("event", "")).startswith("claim.") and "first-day" in d["msg"]]
    assert [d["gpu"] for d in logged] == [uuid, uuid]


# -- events across restarts ------------------------------------------------------------------


def test_a_cursor_beyond_the_newest_event_is_a_reset(agent: AgentProcess) -> None:
    """``?since=`` beyond the newest event is answered ``reset: true`` with everything kept
    and the real ``last_seq``, never the cursor echoed back."""
    now = agent.request("GET", "/v1/events").body
    beyond = agent.request("GET", "/v1/events?since=99999").body
    assert beyond["reset"] is True and now["reset"] is False
    assert beyond["last_seq"] == beyond["events"][-1]["seq"] < 99999
    assert beyond["epoch"] == now["epoch"]
    assert agent.request("GET", "/v1/events?epoch=nothex").status == 422


def test_events_keep_their_history_and_change_epoch_across_a_restart(tmp_path: Path) -> None:
    """After a restart the epoch differs, earlier events are still listed, sequence numbers
    go on rising, and a cursor from before the restart reads on from its place."""
    state = tmp_path / "state"
    first = start_agent(state)
    try:
        before = first.request("GET", "/v1/events").body
    finally:
        assert first.stop() == 0
    second = start_agent(state)
    try:
        after = second.request("GET", "/v1/events").body
        assert after["epoch"] != before["epoch"]
        old = [e for e in after["events"] if e["epoch"] == before["epoch"]]
        assert [e["seq"] for e in old][:len(before["events"])] == \
            [e["seq"] for e in before["events"]]
        assert "agent.stopped" in {e["kind"] for e in old}
        new = [e for e in after["events"] if e["epoch"] == after["epoch"]]
        assert new and min(e["seq"] for e in new) > max(e["seq"] for e in old)
        resumed = second.request(
            "GET", f"/v1/events?since={before['last_seq']}&epoch={before['epoch']}").body
        assert resumed["reset"] is False
        assert [e["seq"] for e in resumed["events"]] == [
            e["seq"] for e in after["events"] if e["seq"] > before["last_seq"]]
        gone = second.request("GET", f"/v1/events?since=1&epoch={'0' * 16}").body
        assert gone["reset"] is True and len(gone["events"]) == len(after["events"])
    finally:
        second.stop(signal.SIGKILL)


# -- the CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "ok"), [
    ("{host}:{port}", True),
    ("http://{host}:{port}", True),
    ("ftp://{host}:{port}", False),
    ("{host}:notaport", False),
    ("http://{host}:{port}/v1/gpus", False),
])
def test_cli_url_with_or_without_scheme(agent: AgentProcess, url: str, ok: bool) -> None:
    """``--url HOST:PORT`` reaches the agent like ``http://HOST:PORT``; any other form is
    refused as a malformed URL, never as "connection refused"."""
    host, port = agent.address
    done = _cli(agent, "gpus", url=url.format(host=host, port=port))
    if ok:
        assert done.returncode == 0, done.stderr
        assert "H100" in done.stdout
    else:
        assert done.returncode == 2  # a usage error, as argparse's own
        assert "malformed URL" in done.stderr and "Traceback" not in done.stderr


def test_cli_output_into_a_closed_pipe_is_no_traceback(agent: AgentProcess) -> None:
    """A reader that went away (``| head``) ends the CLI quietly with 141, no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "agent", "gpus", "--json", "--url",
                               agent.url], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=60, check=False)
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_a_port_in_use_is_one_clear_line(agent: AgentProcess, tmp_path: Path) -> None:
    """A second agent asked to listen on a port the first holds exits 2 with one line naming
    the address, not a traceback."""
    host, port = agent.address
    done = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100", "--state-dir",
         str(tmp_path / "other"), "--listen", f"{host}:{port}"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"gpu-agent: cannot listen on {host}:{port}: ")
    assert "in use" in last


def _healthy(agent: AgentProcess, index: int) -> bool:
    return bool(agent.request("GET", f"/v1/gpus/{index}").body["health"]["healthy"])


def test_sim_controls_take_gpu_indices(agent: AgentProcess) -> None:
    """``sim xid``, ``sim reset``, ``sim process add`` and ``sim fault add --gpu`` take an index
    like the rest of the API, and a simulated reset clears the XID mark it repairs."""
    uuid = agent.request("GET", "/v1/gpus/4").body["uuid"]
    assert _sim(agent, "xid", "4", "48").returncode == 0
    _poll(lambda: not _healthy(agent, 4), "GPU 4 to read unhealthy")
    reset = _sim(agent, "reset", "4")
    assert reset.returncode == 0, reset.stderr
    assert _healthy(agent, 4)
    process = _sim(agent, "process", "add", "4")
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout)["device"] == uuid
    assert _sim(agent, "process", "rm", str(json.loads(process.stdout)["pid"])) \
        .returncode == 0
    fault = agent.request("POST", "/v1/sim/faults", {
        "function": "nvmlDeviceGetPowerUsage", "error": "NVML_ERROR_UNKNOWN", "gpu": "4",
        "skip": 100000})
    assert fault.status == 201 and fault.body["gpu"] == uuid
    assert agent.request("DELETE", "/v1/sim/faults").status == 204
    unknown = agent.request("POST", "/v1/sim/xid", {"gpu": "9", "xid": 48})
    assert unknown.status == 404 and "'9'" in unknown.body["detail"]


def test_admin_clear_xid_lifts_the_mark_once(agent: AgentProcess) -> None:
    """After a critical XID, ``gpu-agent admin clear-xid N`` makes the GPU healthy again and
    says what it cleared, with an event; on a GPU without a mark it is a 409."""
    assert agent.request("POST", "/v1/sim/xid", {"gpu": "5", "xid": 48}).status == 202
    _poll(lambda: not _healthy(agent, 5), "GPU 5 to read unhealthy")
    assert agent.request("POST", "/v1/admin/gpus/5/clear-health", token=None).status == 401
    done = _cli(agent, "admin", "clear-xid", "5")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cleared"] == ["XID 48: Double Bit ECC Error"]
    assert _healthy(agent, 5)
    kinds = [e["kind"] for e in agent.request("GET", "/v1/events").body["events"]
             if e["gpu"] == json.loads(done.stdout)["gpu"]]
    # After the XID: the clear (the availability loop's gpu.taint_removed may come either side).
    assert "gpu.health_cleared" in kinds[len(kinds) - kinds[::-1].index("gpu.xid"):]
    again = _cli(agent, "admin", "clear-xid", "5")
    assert again.returncode == 1 and "409" in again.stderr


def test_checkpoint_restore_takes_an_operators_backup(tmp_path: Path) -> None:
    """``admin checkpoint restore`` takes any file of the checkpoint beside it, e.g. an
    operator's ``claims.checkpoint.backup``, not only a kept-aside one."""
    state = tmp_path / "state"
    agent = start_agent(state)
    agent.stop()
    good = (state / "claims.checkpoint").read_bytes()
    (state / "claims.checkpoint").write_bytes(good[:-40] + b"garbage")
    (state / "claims.checkpoint.backup").write_bytes(good)
    agent = start_agent(state, wait_ready=False)
    try:
        _poll(lambda: "checkpoint" in str(agent.request("GET", "/readyz", token=None).body),
              "/readyz to name the checkpoint", timeout=30)
        listed = agent.request("GET", "/v1/admin/claims-checkpoint").body["kept"]
        assert "claims.checkpoint.backup" in listed
        done = _cli(agent, "admin", "checkpoint", "restore", "claims.checkpoint.backup")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["ready"] is True
    finally:
        agent.stop(signal.SIGKILL)
