"""A GPU reset by --gpu-reset-command answers afresh: its XID marks are cleared."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

from tests.agent_process import start_agent
from tests.waiting import wait_for


def test_a_reset_by_the_reset_command_clears_the_xid_marks(tmp_path: Path) -> None:
    """XID 48 marks GPU 4 unhealthy; a mode change with allow_reset runs the reset command
    (a script that exits 0), and the mark is gone once it has: the GPU reads healthy and
    available again, with a gpu.health_cleared event."""
    state = tmp_path / "state"
    log = tmp_path / "resets.log"
    script = tmp_path / "reset-gpu"
    script.write_text(f"#!/bin/sh\necho \"$1\" >> {log}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    agent = start_agent(state, preset="dgx-a100",
                        extra=["--gpu-reset-command", f"{script} {{uuid}}"])
    try:
        uuid = agent.request("GET", "/v1/gpus/4", token=None).body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 48}).status == 202
        wait_for(lambda: not agent.request("GET", "/v1/gpus/4", token=None)
                 .body["health"]["healthy"], "GPU 4 to read unhealthy after XID 48",
                 every_s=0.05)
        reply = agent.request("PUT", "/v1/gpus/4/mig", {"mig_enabled": True,
                                                        "allow_reset": True})
        assert reply.status == 202, reply.body
        transition = reply.headers["location"]
        wait_for(lambda: agent.request("GET", transition, token=None).body["state"] in (
                 "succeeded", "pending_reset", "rolled_back", "failed"),
                 "the transition to end or wait for a reset", 20, every_s=0.05)
        assert log.read_text().split() == [uuid]
        gpu = agent.request("GET", "/v1/gpus/4", token=None).body
        assert gpu["health"]["healthy"] is True, gpu["health"]
        assert gpu["availability"]["state"] == "available"
        events = agent.request("GET", "/v1/events", token=None).body["events"]
        assert any(e["kind"] == "gpu.health_cleared" and e.get("gpu") == uuid for e in events)
    finally:
        agent.stop(signal.SIGKILL)
