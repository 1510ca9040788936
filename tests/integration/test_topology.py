"""Topology and ResourceSlices against real agent processes: the done-when answers over the
API and the CLI, and the pool generation across a restart."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from agent.dra.rules import check
from tests.agent_process import AgentProcess, start_agent
from tests.integration.test_cli import cli


@pytest.fixture(scope="module")
def bridged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path_factory.mktemp("bridged") / "state",
                        preset="a100-pcie-bridged")
    yield agent
    agent.stop(signal.SIGKILL)


def test_h100_matrix_over_the_api_and_cli(h100: AgentProcess) -> None:
    """Done-when: NV18 on every pair and one island; the CLI prints it as topo -m does."""
    body = h100.request("GET", "/v1/topology").body
    assert {c for row in body["matrix"] for c in row} == {"X", "NV18"}
    assert body["islands"] == [list(range(8))]
    assert body["gpus"][4]["cpu_affinity"] == "56-111,168-223"
    assert {p["bandwidth_gb_s"] for p in body["pairs"]} == {450.0}
    out = cli("topo", "--url", h100.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split("\t")[1:3] == ["GPU0", "GPU1"]
    assert lines[1].split("\t")[:3] == ["GPU0", " X ", "NV18"]
    assert "Legend:" in out.stdout


def test_bridged_selection_done_when(bridged: AgentProcess) -> None:
    """Done-when: a bridged pair for 2, two bridged pairs on one NUMA node for 4; after XID 79
    on GPU 2, a pair with GPU 0 whose PCIe bottleneck the answer names."""
    pairs = {(0, 2), (1, 3), (4, 5), (6, 7)}
    body = bridged.request("GET", "/v1/topology").body
    assert body["islands"] == [[0, 2], [1, 3], [4, 5], [6, 7]]
    two = bridged.request("POST", "/v1/topology/select", {"count": 2})
    assert two.status == 200, two.body
    assert tuple(two.body["gpus"]) in pairs and two.body["bottleneck_link"] == "nvlink"
    four = bridged.request("POST", "/v1/topology/select", {"count": 4}).body
    assert sum(1 for p in pairs if set(p) <= set(four["gpus"])) == 2
    assert len(four["numa_nodes"]) == 1
    uuid = bridged.request("GET", "/v1/gpus/2").body["uuid"]
    assert bridged.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202
    pick = bridged.request("POST", "/v1/topology/select", {"count": 2, "must_include": [0]})
    assert pick.status == 200, pick.body
    assert 0 in pick.body["gpus"] and 2 not in pick.body["gpus"]
    assert pick.body["bottleneck_link"] == "pcie"
    assert "PCIe" in pick.body["explanation"]
    assert pick.body["excluded"][0]["gpu"] == 2
    by_uuid = bridged.request("POST", "/v1/topology/select",
                              {"count": 1, "must_include": [uuid]})
    assert by_uuid.status == 409
    assert by_uuid.headers["content-type"].startswith("application/problem+json")
    bad = bridged.request("POST", "/v1/topology/select", {"count": 0})
    assert bad.status == 422
    out = cli("topo", "select", "2", "--url", bridged.url, "--token-file",
              str(bridged.state_dir / "tokens"), "--must-include", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("GPUs: 1, 3")


def _validate(body: dict[str, Any], version: str) -> None:
    for item in body["items"]:
        kubernetes_validate.validate(item, f"{version}.0", strict=True)
    assert check(body["items"], tuple(int(p) for p in version.split("."))) == []


def test_dynamic_slices_and_generation_across_restart(tmp_path: Path) -> None:
    """Done-when on a real agent: dgx-h100 with --dynamic-mig, both layouts validate; the
    generation stays across a restart with the same content and grows when it changes."""
    state = tmp_path / "state"
    agent = start_agent(state, extra=["--dynamic-mig", "--driver-name", "gpu.example.com"])
    try:
        old = agent.request("GET", "/v1/resourceslices?kubernetes=1.34").body
        new = agent.request("GET", "/v1/resourceslices?kubernetes=1.35").body
        _validate(old, "1.34")
        _validate(new, "1.35")
        assert len(old["items"]) == 8 and len(new["items"]) == 9
        assert new["items"][1]["spec"]["driver"] == "gpu.example.com"
        generation = new["items"][0]["spec"]["pool"]["generation"]
        assert agent.request("GET", "/v1/resourceslices?kubernetes=1.20").status == 422
    finally:
        agent.stop()
    agent = start_agent(state, extra=["--dynamic-mig", "--driver-name", "gpu.example.com"])
    try:
        again = agent.request("GET", "/v1/resourceslices").body
        assert again["items"][0]["spec"]["pool"]["generation"] == generation
        uuid = agent.request("GET", "/v1/gpus/7").body["uuid"]
        agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79})
        changed = agent.request("GET", "/v1/resourceslices").body
        assert changed["items"][0]["spec"]["pool"]["generation"] == generation + 1
        _validate(changed, "1.35")
    finally:
        agent.stop()


def test_l40s_topology_has_no_nvlink(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state", preset="l40s")
    try:
        body = agent.request("GET", "/v1/topology").body
        assert not any(c.startswith("NV") for row in body["matrix"] for c in row)
        assert body["islands"] == []
        pick = agent.request("POST", "/v1/topology/select", {"count": 2}).body
        assert pick["bottleneck_link"] == "pcie" and pick["numa_nodes"] == [0]
    finally:
        agent.stop()
