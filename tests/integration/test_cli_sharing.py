"""``gpu-agent gpus`` and ``gpu-agent claims`` on shared and held GPUs, against a real agent
process (issue 23): claims show their sharing, share and MPS daemon state; AVAILABLE says what
is left of a shared GPU and that a held one is not available; HELD BY names each share."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.integration.test_cli import cli
from tests.waiting import wait_for

MPS_50 = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
SHARE = {"kind": "gpu", "device": "0", "capacity": {"memory": "10Gi"}}


@pytest.fixture
def l40s(tmp_path: Path) -> Iterator[AgentProcess]:
    """A simulated L40S node: GPU 0 shared by two 10 GiB shares, GPU 1 held whole, GPU 2 held
    under MPS at 50 %, GPU 3 free. Every claim is unprepared at the end."""
    with tempfile.TemporaryDirectory(prefix="mps-") as mps_root:
        agent = start_agent(tmp_path / "state", preset="l40s",
                            extra=["--mps-root", mps_root, "--gpu-shares"])
        try:
            for uid, device in (("share-a", {**SHARE, "share_id": "id-a"}),
                                ("share-b", {**SHARE, "share_id": "id-b"}),
                                ("held", {"kind": "gpu", "device": "1"}),
                                ("mps", {"kind": "gpu", "device": "2", "sharing": MPS_50})):
                reply = agent.request("PUT", f"/v1/claims/{uid}", {"devices": [device]})
                assert reply.status == 200, reply.body
            yield agent
        finally:
            try:
                for claim in agent.request("GET", "/v1/claims").body["claims"]:
                    agent.request("DELETE", f"/v1/claims/{claim['uid']}")
            finally:
                agent.stop()


def _opts(agent: AgentProcess) -> list[str]:
    return ["--url", agent.url, "--token-file", str(agent.state_dir / "tokens")]


def _rows(stdout: str) -> dict[str, dict[str, str]]:
    """A table's rows by their first cell, each cell under its header (cells are split on
    the two spaces between columns)."""
    lines = stdout.splitlines()
    header = lines[0]
    starts = [i for i in range(len(header))
              if header[i] != " " and (i == 0 or header[i - 2:i] == "  ")]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows[cells[0]] = dict(zip(names, cells, strict=True))
    return rows


def test_available_is_right_for_shared_held_and_free_gpus(l40s: AgentProcess) -> None:
    """A shared GPU shows the memory its shares left and each share in HELD BY (not "whole
    GPU"); a GPU held whole, under MPS or not, is not available (not "ok"); a free one is."""
    out = cli("gpus", "-o", "wide", *_opts(l40s))
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert rows["0"]["AVAILABLE"] == "shares: 24576 of 45056 MiB left"
    assert rows["0"]["HELD BY"] == "share-a (share 10240 MiB), share-b (share 10240 MiB)"
    assert rows["1"]["AVAILABLE"] == "NO: held"
    assert rows["1"]["HELD BY"] == "held (whole GPU)"
    assert rows["2"]["AVAILABLE"] == "NO: held"
    assert (rows["3"]["AVAILABLE"], rows["3"]["HELD BY"], rows["3"]["TAINTS"]) == (
        "ok", "-", "-")


def test_claims_show_sharing_share_and_mps_state(l40s: AgentProcess) -> None:
    """The list shows each claim's sharing, share and daemon state, and a daemon that died
    as failed with why; ``claims UID`` shows them too."""
    out = cli("claims", *_opts(l40s))
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert {k: rows["share-a"][k] for k in ("SHARING", "SHARE", "MPS")} == {
        "SHARING": "MPS 22% 10240 MiB", "SHARE": "10240 MiB id-a", "MPS": "running"}
    assert {k: rows["mps"][k] for k in ("SHARING", "SHARE", "MPS")} == {
        "SHARING": "MPS 50%", "SHARE": "-", "MPS": "running"}
    assert {k: rows["held"][k] for k in ("SHARING", "SHARE", "MPS", "NOTES")} == {
        "SHARING": "-", "SHARE": "-", "MPS": "-", "NOTES": "-"}

    pipe = l40s.request("GET", "/v1/claims/mps").body["mps"]["pipe_directory"]
    (daemon,) = [d for d in l40s.request("GET", "/v1/sim").body["mps_daemons"]
                 if d["pipe_directory"] == pipe]
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_for(lambda: _rows(cli("claims", *_opts(l40s)).stdout)["mps"]["MPS"] == "failed",
             "the dead daemon shown failed", 30, every_s=0.5)
    # The default table fits 120 columns (NOTES cut); -o wide shows the whole note.
    failed = _rows(cli("claims", "-o", "wide", *_opts(l40s)).stdout)["mps"]
    assert "MPS: its MPS control daemon stopped answering" in failed["NOTES"]
    shown = cli("claims", "mps", *_opts(l40s))
    assert shown.returncode == 0, shown.stderr
    assert "mps       failed: its MPS control daemon stopped answering" in shown.stdout
    assert f"mps pipe  {pipe}" in shown.stdout
    assert "MPS 50%" in shown.stdout
