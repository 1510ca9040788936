"""The dashboard's "Claims, shares, MPS and taints" panels have data through a real
Prometheus (issue 23): Debian's Prometheus scrapes a real agent (a simulated L40S node with
GPU shares and a tainted GPU) and the kubelet plugin's health listener, evaluates the shipped
recording rules, and answers every query of those panels, as Grafana would send it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.kubeplugin.conftest import (
    Agent,
    Kubelet,
    close_kubelet,
    open_kubelet,
    settings_for,
    start_with_plugin_token,
)
from tests.tools import require_tool
from tests.waiting import until

MONITORING = Path(__file__).resolve().parents[2] / "daemonset" / "monitoring"
DASHBOARD = MONITORING / "gpu-node-agent-dashboard.json"
RULES = MONITORING / "gpu-node-agent-rules.yaml"
ROW = "Claims, shares, MPS and taints"


def row_panels(title: str) -> list[dict[str, Any]]:
    """The panels under the row ``title``, up to the next row."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    found = []
    for panel in panels[start + 1:]:
        if panel["type"] == "row":
            break
        found.append(panel)
    return found


def grafana(expr: str) -> str:
    """A panel query as Grafana sends it with every template variable at "All"."""
    for variable in ("$job", "$Hostname", "$gpu"):
        expr = expr.replace(variable, ".*")
    return expr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def prometheus(targets: Sequence[str], rules: Path, directory: Path) -> Iterator[str]:
    """A Prometheus server scraping ``targets`` every second, evaluating ``rules`` every
    second; yields its query URL."""
    binary = require_tool("prometheus", "apt-get install prometheus")
    port = free_port()
    config = directory / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        "  - job_name: gpu-node-agent\n"
        f"    static_configs: [{{targets: {json.dumps(list(targets))}}}]\n")
    with (directory / "prometheus.log").open("wb") as log:
        server = subprocess.Popen([binary, f"--config.file={config}",
                                   f"--storage.tsdb.path={directory / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}/api/v1/query"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def query(url: str, promql: str) -> list[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode({'query': promql})}",
                                    timeout=10) as reply:
            return list(json.loads(reply.read())["data"]["result"])
    except OSError:
        return []  # not up yet


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[Agent, Kubelet]]:
    """An L40S agent publishing shares, with the plugin running in this loop."""
    with tempfile.TemporaryDirectory(prefix="kp-", dir="/tmp") as short, \
            tempfile.TemporaryDirectory(prefix="mps-") as mps_root:
        agent = start_with_plugin_token(Path(short) / "state", preset="l40s", extra=[
            "--gpu-shares", "--mps-root", mps_root, "--metrics-listen", "127.0.0.1:0",
            "--collect-interval", "0.5"])
        kubelet = await open_kubelet(settings_for(Path(short), agent))
        try:
            yield agent, kubelet
        finally:
            await close_kubelet(kubelet)
            for claim in agent.process.request("GET", "/v1/claims").body["claims"]:
                agent.process.request("DELETE", f"/v1/claims/{claim['uid']}")
            agent.process.stop(signal.SIGKILL)


async def test_every_claims_shares_and_mps_panel_has_data(node: tuple[Agent, Kubelet],
                                                          tmp_path: Path) -> None:
    """Two 10 GiB shares of GPU 0 (one MPS client using 3000 MiB) and XID 48 on GPU 3: every
    query of the row answers at least one series, and the per-claim framebuffer, the shares
    taken and the taint are the node's own."""
    agent, kubelet = node
    process = agent.process
    share = {"kind": "gpu", "device": "0", "capacity": {"memory": "10Gi"}}
    claims = []
    for uid in ("share-a", "share-b"):
        reply = process.request("PUT", f"/v1/claims/{uid}", {"devices": [share]})
        assert reply.status == 200, reply.body
        claims.append(reply.body)
    added = process.request("POST", "/v1/sim/processes", {
        "device": claims[0]["devices"][0]["uuid"], "used_memory_mib": 3000,
        "mps_pipe_directory": claims[0]["mps"]["pipe_directory"]})
    assert added.status in (200, 201), added.body
    assert process.request("POST", "/v1/sim/xid", {"gpu": "3", "xid": 48}).status == 202
    listeners = json.loads((process.state_dir / "listeners.json").read_text())
    agent_target = urllib.parse.urlsplit(listeners["metrics"][0]).netloc
    plugin_target = urllib.parse.urlsplit(kubelet.health_url).netloc
    panels = row_panels(ROW)
    assert len(panels) >= 10, [p["title"] for p in panels]
    with prometheus([agent_target, plugin_target], RULES, tmp_path) as url:
        for panel in panels:
            for target in panel["targets"]:
                promql = grafana(target["expr"])
                await until(lambda q=promql: asyncio.to_thread(query, url, q),
                            f"data for panel {panel['title']!r}: {promql}", 60, every_s=0.5)
        per_claim = await until(lambda: asyncio.to_thread(
            query, url, 'claim:DCGM_FI_DEV_FB_USED:sum{claim_uid="share-a"}'),
            "share-a's framebuffer", 30, every_s=0.5)
        assert per_claim[0]["value"][1] == "3000"
        taken = await asyncio.to_thread(query, url, grafana(next(
            p for p in panels if p["title"] == "GPU share memory taken")["targets"][0]["expr"]))
        assert {r["metric"]["gpu"]: float(r["value"][1]) for r in taken} == {
            "0": 20480 / 45056, "1": 0.0, "2": 0.0, "3": 0.0}
        tainted = await asyncio.to_thread(query, url, grafana(next(
            p for p in panels if p["title"] == "Tainted devices by key")["targets"][0]["expr"]))
        assert [(r["metric"]["key"], r["metric"]["effect"], r["value"][1]) for r in tainted] == [
            ("gpu.nodeagent.dev/xid", "NoSchedule", "1")]
