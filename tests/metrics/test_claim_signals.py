"""The claims' operator signals of a real ``gpu-agent serve`` (issue 23): claims by state and
a prepare that is stuck, each shareable GPU's capacity, taken and left memory, the MPS daemons
by state, and a shared GPU's framebuffer attributed to each share's claim in the DCGM series."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.metrics.textformat import Exposition, parse
from tests.waiting import wait_for

MIB = 1024 * 1024
L40S_SHAREABLE_MIB = 45056  # 46,068 MiB rounded down to whole GiB
MPS = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}


def scrape(agent: AgentProcess) -> Exposition:
    return parse(agent.request("GET", "/metrics").body)


def value(agent: AgentProcess, name: str, **labels: str) -> float | None:
    found = [s.value for s in scrape(agent).named(name)
             if all(s.labels.get(k) == v for k, v in labels.items())]
    return found[0] if len(found) == 1 else None


def prepare(agent: AgentProcess, uid: str, device: dict[str, Any],
            metadata: dict[str, str] | None = None) -> Any:
    reply = agent.request("PUT", f"/v1/claims/{uid}", {"devices": [device],
                                                      "metadata": metadata or {}})
    assert reply.status == 200, reply.body
    return reply.body


@pytest.fixture
def l40s(tmp_path: Path) -> Iterator[AgentProcess]:
    """A simulated L40S node publishing GPU shares, collecting every 0.2 s; every claim is
    unprepared at the end, so no MPS daemon outlives the test."""
    with tempfile.TemporaryDirectory(prefix="mps-") as mps_root:
        agent = start_agent(tmp_path / "state", preset="l40s", extra=[
            "--mps-root", mps_root, "--gpu-shares", "--collect-interval", "0.2"])
        try:
            yield agent
        finally:
            try:
                for claim in agent.request("GET", "/v1/claims").body["claims"]:
                    agent.request("DELETE", f"/v1/claims/{claim['uid']}")
            finally:
                agent.stop()


def test_shares_daemons_and_claims_are_series(l40s: AgentProcess) -> None:
    """Two 10 GiB shares of GPU 0 and an MPS claim holding GPU 1 whole: GPU 0 has 20 GiB
    taken and 24 GiB left by two claims, GPU 1 all taken, GPU 2 all left; three claims are
    prepared and three daemons run; a daemon killed shows as failed."""
    share = {"kind": "gpu", "device": "0", "capacity": {"memory": "10Gi"}}
    prepare(l40s, "share-a", share)
    prepare(l40s, "share-b", share)
    whole = prepare(l40s, "whole", {"kind": "gpu", "device": "1", "sharing": MPS})

    def gpu(name: str, index: int) -> float | None:
        return value(l40s, f"gpu_agent_gpu_share_{name}", gpu=str(index))

    wait_for(lambda: gpu("claims", 0) == 2 and gpu("claims", 1) == 1
             and value(l40s, "gpu_agent_claims", state="prepared") == 3,
             "the claims in the metrics", 20)
    assert (gpu("capacity_bytes", 0), gpu("taken_bytes", 0), gpu("left_bytes", 0)) == (
        L40S_SHAREABLE_MIB * MIB, 20480 * MIB, (L40S_SHAREABLE_MIB - 20480) * MIB)
    assert (gpu("taken_bytes", 1), gpu("left_bytes", 1)) == (L40S_SHAREABLE_MIB * MIB, 0)
    assert (gpu("taken_bytes", 2), gpu("left_bytes", 2), gpu("claims", 2)) == (
        0, L40S_SHAREABLE_MIB * MIB, 0)
    assert {s.labels["state"]: s.value for s in scrape(l40s).named("gpu_agent_claims")} == {
        "reserved": 0, "prepared": 3, "releasing": 0}
    assert value(l40s, "gpu_agent_claims_oldest_reserved_seconds") == 0
    assert value(l40s, "gpu_agent_mps_daemons", state="running") == 3

    daemons = l40s.request("GET", "/v1/sim").body["mps_daemons"]
    (daemon,) = [d for d in daemons if d["pipe_directory"] == whole["mps"]["pipe_directory"]]
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_for(lambda: value(l40s, "gpu_agent_mps_daemons", state="failed") == 1,
             "the killed daemon counted failed", 30, every_s=0.2)
    assert value(l40s, "gpu_agent_mps_daemons", state="running") == 2


def test_a_shared_gpus_framebuffer_is_attributed_to_each_shares_claim(
        l40s: AgentProcess) -> None:
    """Each share of GPU 0 has its own DCGM series, labelled with its claim, whose
    framebuffer used is its MPS clients' (3000 and 5000 MiB) and free what is left of its
    10 GiB share; no series of GPU 0 names one claim for the whole GPU."""
    share = {"kind": "gpu", "device": "0", "capacity": {"memory": "10Gi"}}
    a = prepare(l40s, "share-a", share, {"namespace": "ml", "name": "claim-a", "pod": "pod-a"})
    b = prepare(l40s, "share-b", share, {"namespace": "ml", "name": "claim-b", "pod": "pod-b"})
    uuid = a["devices"][0]["uuid"]
    for claim, used in ((a, 3000), (b, 5000)):
        added = l40s.request("POST", "/v1/sim/processes", {
            "device": uuid, "used_memory_mib": used,
            "mps_pipe_directory": claim["mps"]["pipe_directory"]})
        assert added.status in (200, 201), added.body

    def per_claim(name: str) -> dict[str, float] | None:
        series = [s for s in scrape(l40s).named(name) if s.labels["gpu"] == "0"]
        found = {s.labels.get("claim_uid", ""): s.value for s in series}
        return found if len(found) == len(series) else None

    wait_for(lambda: per_claim("DCGM_FI_DEV_FB_USED") == {"share-a": 3000, "share-b": 5000},
             "GPU 0's framebuffer per share", 20, every_s=0.2)
    assert per_claim("DCGM_FI_DEV_FB_FREE") == {"share-a": 10240 - 3000,
                                                "share-b": 10240 - 5000}
    temps = [s for s in scrape(l40s).named("DCGM_FI_DEV_GPU_TEMP") if s.labels["gpu"] == "0"]
    assert sorted((s.labels["claim_uid"], s.labels["pod"]) for s in temps) == [
        ("share-a", "pod-a"), ("share-b", "pod-b")]


def test_a_prepare_that_hangs_shows_as_reserved_with_its_age(tmp_path: Path) -> None:
    """A prepare held up in NVML (8 s on the read that confirms the device) is a reserved
    claim whose age grows; once it is done the claim is prepared and no age is left."""
    agent = start_agent(tmp_path / "state", preset="l40s",
                        extra=["--collect-interval", "0.2"])
    try:
        assert agent.request("PUT", "/v1/sim/latency",
                             {"nvmlDeviceGetMinorNumber": 8}).status == 200
        pending = agent.send("PUT", "/v1/claims/slow",
                             {"devices": [{"kind": "gpu", "device": "3"}]})
        wait_for(lambda: value(agent, "gpu_agent_claims", state="reserved") == 1,
                 "the prepare reserved", 15, every_s=0.1)
        wait_for(lambda: (value(agent, "gpu_agent_claims_oldest_reserved_seconds") or 0) >= 2,
                 "the reservation's age to grow", 15, every_s=0.2)
        assert agent.request("PUT", "/v1/sim/latency", {}).status == 200
        reply = pending.reply()
        assert reply.status == 200, reply.body
        wait_for(lambda: value(agent, "gpu_agent_claims", state="prepared") == 1,
                 "the claim prepared", 15, every_s=0.1)
        assert value(agent, "gpu_agent_claims", state="reserved") == 0
        assert value(agent, "gpu_agent_claims_oldest_reserved_seconds") == 0
    finally:
        agent.request("DELETE", "/v1/claims/slow")
        agent.stop(signal.SIGKILL)
