"""Metrics of a real ``gpu-agent serve`` process, checked by Prometheus' own tools: promtool
lints a real scrape, a real Prometheus server ingests it, and an XID injected through the
simulator shows in the metrics, ``/v1/gpus`` and ``/v1/events``."""

from __future__ import annotations

import gzip
import json
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.agent_process import AgentProcess, start_agent
from tests.metrics.textformat import parse
from tests.tools import require_tool

# promtool lint messages that dcgm-exporter compatibility forces on the DCGM families only.
DCGM_LINT = ("label names should be written in 'snake_case' not 'camelCase'",
             'counter metrics should have "_total" suffix',
             # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
             "metric name should not include type 'counter'")
ONE_G = ["1g.10gb"] * 7


def metrics_url(agent: AgentProcess) -> str:
    return str(json.loads((agent.state_dir / "listeners.json").read_text())["metrics"][0])


def get(url: str, headers: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read(), {k.lower(): v for k, v in reply.getheaders()}


def wait_for(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    return waiting.wait_for(check, what, timeout, every_s=0.2)


def split_gpu(agent: AgentProcess, gpu: int, profiles: list[str]) -> None:
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": profiles})
    assert reply.status in (200, 202), reply.body
    transition = reply.body.get("transition")
    if transition:
        wait_for(lambda: agent.request("GET", f"/v1/transitions/{transition['id']}")
                 .body["state"] == "succeeded", "the MIG transition")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = start_agent(tmp_path_factory.mktemp("metrics") / "state",
                          extra=["--metrics-listen", "127.0.0.1:0", "--collect-interval", "0.5",
                                 "--node-name", "node-a"])
    yield process
    process.stop(signal.SIGKILL)


def test_a_real_prometheus_ingests_the_agents_metrics(agent: AgentProcess,
                                                      tmp_path: Path) -> None:
    """Debian's Prometheus scrapes the metrics listener: GPU_UTIL for the 8 H100s, then
    FB_USED of seven 1g.10gb GPU instances after the geometry change on GPU 0."""
    prometheus = require_tool("prometheus", "apt-get install prometheus")
    port = _free_port()
    target = urllib.parse.urlsplit(metrics_url(agent)).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gpu-node-agent\n    static_configs: [{{targets: ['{target}']}}]\n")
    log = (tmp_path / "prometheus.log").open("wb")
    server = subprocess.Popen([prometheus, f"--config.file={config}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        def query(promql: str) -> list[dict[str, Any]]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
                {"query": promql})
            try:
                body, _ = get(url)
            except OSError:
                return []
            return list(json.loads(body)["data"]["result"])

        util = wait_for(lambda: (r := query("DCGM_FI_DEV_GPU_UTIL")) and len(r) == 8 and r,
                        "DCGM_FI_DEV_GPU_UTIL of 8 GPUs")
        assert {r["metric"]["modelName"] for r in util} == {"NVIDIA H100 80GB HBM3"}
        assert {r["metric"]["Hostname"] for r in util} == {"node-a"}
        assert {r["metric"]["gpu"] for r in util} == {str(i) for i in range(8)}
        split_gpu(agent, 0, ONE_G)
        mig = wait_for(lambda: (r := query('DCGM_FI_DEV_FB_USED{GPU_I_PROFILE="1g.10gb"}'))
                       and len(r) == 7 and r, "FB_USED of seven 1g.10gb instances")
        parent = agent.request("GET", "/v1/gpus/0").body["uuid"]
        assert {r["metric"]["UUID"] for r in mig} == {parent}
        assert len({r["metric"]["GPU_I_ID"] for r in mig}) == 7
        up = query('up{job="gpu-node-agent"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()


def test_promtool_lints_a_real_scrape(agent: AgentProcess) -> None:
    """No parse error, no duplicate series, and lint messages only where dcgm-exporter's names
    force them (camelCase labels, counters without _total) on DCGM families."""
    promtool = require_tool("promtool", "apt-get install prometheus")
    split_gpu(agent, 1, ["3g.40gb", "2g.20gb", "1g.10gb"])

    def scrape_with_mig_devices() -> tuple[bytes, dict[str, str]] | None:
        # The scrape serves the last collection round: the new instances from the next one.
        body, headers = get(metrics_url(agent) + "/metrics")
        return (body, headers) if b"GPU_I_PROFILE" in body else None

    body, headers = wait_for(scrape_with_mig_devices, "a scrape with the MIG devices of GPU 1")
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    out = parse(body.decode())
    keys = [(s.name, tuple(sorted(s.labels.items()))) for s in out.samples]
    assert len(keys) == len(set(keys)), "duplicate series"
    assert any("GPU_I_PROFILE" in s.labels for s in out.samples)
    lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                          timeout=60, check=False)
    messages = (lint.stdout + lint.stderr).decode().splitlines()
    # 1 is a parse error ("error while linting: ..."), 3 lint findings only.
    assert lint.returncode in (0, 3), messages
    assert not [m for m in messages if m.startswith("error")], messages
    for message in messages:
        name, _, problem = message.partition(" ")
        assert name.startswith("DCGM_FI_") and problem in DCGM_LINT, message


def test_gzip_when_asked_on_both_listeners(agent: AgentProcess) -> None:
    for base in (metrics_url(agent), agent.url):
        body, headers = get(base + "/metrics", {"Accept-Encoding": "gzip"})
        assert headers["content-encoding"] == "gzip"
        text = gzip.decompress(body).decode()
        assert "DCGM_FI_DEV_GPU_TEMP{" in text and "gpu_agent_gpu_healthy{" in text
    ready, _ = get(metrics_url(agent) + "/readyz")
    assert json.loads(ready)["status"] == "ready"


def test_xid_79_shows_in_metrics_gpus_and_events(tmp_path: Path) -> None:
    """XID 79 through the simulator: DCGM_FI_DEV_XID_ERRORS with code and message, the XID
    counter, gpu_agent_gpu_healthy 0, and the reason in /v1/gpus and /v1/events."""
    agent = start_agent(tmp_path / "state", extra=["--collect-interval", "5"])
    try:
        uuid = agent.request("GET", "/v1/gpus/3").body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202

        def scraped() -> Any:
            out = parse(agent.request("GET", "/metrics").body)
            xid = [s for s in out.named("DCGM_FI_DEV_XID_ERRORS") if s.labels["gpu"] == "3"]
            return out if xid and xid[0].value == 79 else None

        out = wait_for(scraped, "XID 79 in /metrics", timeout=4)  # well before the 5 s tick
        xid = next(s for s in out.named("DCGM_FI_DEV_XID_ERRORS") if s.labels["gpu"] == "3")
        assert xid.labels["err_code"] == "79"
        assert xid.labels["err_msg"] == "GPU has fallen off the bus"
        assert xid.labels["UUID"] == uuid
        healthy = {s.labels["gpu"]: s.value for s in out.named("gpu_agent_gpu_healthy")}
        assert healthy == {**{str(i): 1.0 for i in range(8)}, "3": 0.0}
        assert out.named("gpu_agent_xid_errors_total")[0].labels == {"xid": "79"}
        gpu = agent.request("GET", "/v1/gpus/3").body
        assert gpu["health"]["healthy"] is False
        assert "XID 79: GPU has fallen off the bus" in gpu["health"]["reasons"]
        events = agent.request("GET", "/v1/events").body["events"]
        xids = [e for e in events if e["kind"] == "gpu.xid"]
        assert xids and xids[0]["gpu"] == uuid and xids[0]["details"]["xid"] == 79
        assert any(e["kind"] == "gpu.unhealthy" and e["gpu"] == uuid for e in events)
        assert agent.request("GET", "/v1/gpus/2").body["health"]["healthy"] is True
    finally:
        agent.stop(signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_gpu_available_follows_the_ledger(tmp_path: Path) -> None:
    """gpu_agent_gpu_available is the ledger's availability: 1 for every GPU at start, 0 for
    a GPU a critical XID (48, which leaves it on the bus) made unavailable, within one
    collection interval."""
    agent = start_agent(tmp_path / "state", extra=["--collect-interval", "0.2"])
    try:
        def available() -> dict[str, float]:
            out = parse(agent.request("GET", "/metrics").body)
            return {s.labels["gpu"]: s.value for s in out.named("gpu_agent_gpu_available")}

        assert available() == {str(i): 1.0 for i in range(8)}
        uuid = agent.request("GET", "/v1/gpus/2").body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 48}).status == 202
        wait_for(lambda: available().get("2") == 0.0, "GPU 2 unavailable", timeout=5)
        assert available() == {**{str(i): 1.0 for i in range(8)}, "2": 0.0}
    finally:
        agent.stop()
