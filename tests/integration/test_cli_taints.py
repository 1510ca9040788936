"""``gpu-agent gpus`` shows each GPU's and MIG device's taints and why, against a real agent
process (issue 23): a blocking XID taint makes the GPU unavailable, an informational one does
not, and a MIG-scoped XID taints only its instance."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.integration.owner_steps import wait_transition
from tests.integration.test_cli import cli
from tests.integration.test_cli_sharing import _rows
from tests.waiting import wait_for

XID = "gpu.nodeagent.dev/xid"


@pytest.fixture
def h100(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path / "state")
    yield agent
    agent.stop(signal.SIGKILL)


def _tainted(agent: AgentProcess, gpu: str, where: str = "gpu") -> Any:
    body = agent.request("GET", f"/v1/gpus/{gpu}").body
    if where == "gpu":
        return body["taints"]
    return [d for d in body["mig_devices"] if d["taints"]]


def test_gpus_shows_taints_and_why(h100: AgentProcess) -> None:
    """XID 48 on GPU 3: TAINTS shows the NoSchedule taint, AVAILABLE is NO with its reason,
    and the Taints section says why and since when. XID 31 on GPU 4: an informational taint
    (effect None) that leaves the GPU available. An XID on MIG device 5:0: only that
    instance is tainted, and GPU 5 keeps its other instance available."""
    reply = h100.request("PUT", "/v1/gpus/5/mig", {"profiles": ["3g.40gb", "3g.40gb"]})
    assert reply.status in (200, 202), reply.body
    if reply.body.get("transition"):
        done = wait_transition(h100, f"/v1/transitions/{reply.body['transition']['id']}")
        assert done["state"] == "succeeded", done
    for gpu, xid in (("3", 48), ("4", 31), ("5:0", 48)):
        assert h100.request("POST", "/v1/sim/xid", {"gpu": gpu, "xid": xid}).status == 202
    wait_for(lambda: _tainted(h100, "3") and _tainted(h100, "4")
             and _tainted(h100, "5", "mig"), "the three taints in /v1/gpus", 20, every_s=0.2)
    (instance,) = _tainted(h100, "5", "mig")
    since = _tainted(h100, "3")[0]["time_added"]

    out = cli("gpus", "-o", "wide", "--url", h100.url)
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert rows["3"]["TAINTS"] == f"{XID}=48:NoSchedule"
    assert rows["3"]["AVAILABLE"] == "NO: XID 48: Double Bit ECC Error"
    assert (rows["4"]["TAINTS"], rows["4"]["AVAILABLE"]) == (f"{XID}=31:None", "ok")
    assert rows["5"]["TAINTS"] == f"3g.40gb gi {instance['gi_id']}: {XID}=48:NoSchedule"
    assert rows["5"]["AVAILABLE"] == "1 of 2 MIG devices"
    assert rows["2"]["TAINTS"] == "-"
    why = out.stdout.split("\nTaints:\n", 1)[1].splitlines()
    assert f"GPU 3  {XID}=48:NoSchedule  since {since}: XID 48: Double Bit ECC Error" in why
    assert any(line.startswith(f"GPU 4  {XID}=31:None  since ") and "page fault" in line
               for line in why), why
    assert any(line.startswith(f"GPU 5 3g.40gb gi {instance['gi_id']}  {XID}=48:NoSchedule")
               for line in why), why
    assert len(why) == 3, why
