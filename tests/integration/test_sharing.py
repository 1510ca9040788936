"""GPU sharing against a real agent process on a simulated L40S node (issue 16, "Done when"):
two pods on one MPS claim get one control daemon with the limits the simulator reports and
enforces; four 10 GiB shares of one L40S each get their own daemon and limits and a fifth is
refused; time-slicing sets and restores the interval; and a SIGKILL of the agent's whole
process group leaves the daemons running, re-adopted at the restart with no claim lost."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.mpshost.processes import start_host
from tests.waiting import wait_for

MPS_50 = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                           "defaultPinnedDeviceMemoryLimit": "10Gi"}}


@pytest.fixture
def mps_root() -> Iterator[Path]:
    """A short MPS root: pipe directories hold Unix sockets, whose paths have 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="mps-") as directory:
        yield Path(directory)


def start(state: Path, mps_root: Path, *extra: str) -> AgentProcess:
    return start_agent(state, preset="l40s", extra=["--mps-root", str(mps_root), *extra])


def prepare(agent: AgentProcess, uid: str, *devices: dict[str, Any]) -> Any:
    reply = agent.request("PUT", f"/v1/claims/{uid}", {"devices": list(devices)})
    assert reply.status == 200, reply.body
    return reply.body


def sim(agent: AgentProcess) -> Any:
    return agent.request("GET", "/v1/sim").body


def daemon_at(agent: AgentProcess, pipe: str) -> dict[str, Any]:
    (daemon,) = [d for d in sim(agent)["mps_daemons"] if d["pipe_directory"] == pipe]
    return daemon


def client(agent: AgentProcess, device: str, pipe: str, used_mib: int) -> Any:
    return agent.request("POST", "/v1/sim/processes", {
        "device": device, "used_memory_mib": used_mib, "mps_pipe_directory": pipe})


def stop(agent: AgentProcess) -> None:
    """Unprepare every claim (so no daemon outlives the test), then stop the agent."""
    try:
        for claim in agent.request("GET", "/v1/claims").body["claims"]:
            agent.request("DELETE", f"/v1/claims/{claim['uid']}")
    finally:
        agent.stop()


@pytest.fixture
def agent(tmp_path: Path, mps_root: Path) -> Iterator[AgentProcess]:
    started = start(tmp_path / "state", mps_root)
    try:
        yield started
    finally:
        stop(started)


def test_two_pods_on_one_mps_claim_share_one_daemon_held_to_its_limits(
        agent: AgentProcess) -> None:
    """One MPS claim (50 %, 10 GiB) runs one control daemon with exactly those defaults in
    EXCLUSIVE_PROCESS mode; both of its pods' clients are served by it, and an allocation
    above the pinned limit is refused by the simulated driver."""
    claim = prepare(agent, "pods", {"kind": "gpu", "device": "0", "sharing": MPS_50})
    uuid, pipe = claim["devices"][0]["uuid"], claim["mps"]["pipe_directory"]
    assert claim["mps"]["state"] == "running"
    daemon = daemon_at(agent, pipe)
    assert daemon["devices"] == [uuid]
    assert daemon["defaults"] == {"active_thread_percentage": 50,
                                  "pinned_limits_mib": {uuid: 10240}}
    assert sim(agent)["gpus"][0]["compute_mode"] == "EXCLUSIVE_PROCESS"
    for _pod in range(2):
        assert client(agent, uuid, pipe, 4096).status in (200, 201)
    daemons = [d for d in sim(agent)["mps_daemons"] if d["pipe_directory"] == pipe]
    assert len(daemons) == 1
    clients = [c for s in daemons[0]["servers"] for c in s["clients"]]
    assert len(clients) == 2
    refused = client(agent, uuid, pipe, 10241)
    assert refused.status == 422 and "used_memory_mib" in str(refused.body)
    assert agent.request("DELETE", "/v1/claims/pods").status == 204
    assert not [d for d in sim(agent)["mps_daemons"] if d["pipe_directory"] == pipe]
    assert sim(agent)["gpus"][0]["compute_mode"] == "DEFAULT"


def test_four_10gib_shares_fit_an_l40s_and_a_fifth_is_refused(agent: AgentProcess) -> None:
    """Four claims of memory: 10Gi each land on one L40S (46,068 MiB), each with its own
    daemon pinned at 10240 MiB and 22 % of the threads, the GPU left in DEFAULT mode; a fifth
    is a 409 saying what is taken and left, and /v1/gpus shows the holders."""
    pipes = []
    for n in range(4):
        claim = prepare(agent, f"share-{n}", {"kind": "gpu", "device": "0",
                                              "capacity": {"memory": "10Gi"},
                                              "share_id": f"id-{n}"})
        assert claim["devices"][0]["share"] == {"memory_mib": 10240, "share_id": f"id-{n}"}
        pipes.append(claim["mps"]["pipe_directory"])
    uuid = claim["devices"][0]["uuid"]
    for pipe in pipes:
        assert daemon_at(agent, pipe)["defaults"] == {"active_thread_percentage": 22,
                                                      "pinned_limits_mib": {uuid: 10240}}
    assert sim(agent)["gpus"][0]["compute_mode"] == "DEFAULT"
    fifth = agent.request("PUT", "/v1/claims/share-4", {"devices": [
        {"kind": "gpu", "device": "0", "capacity": {"memory": "10Gi"}}]})
    assert fifth.status == 409, fifth.body
    assert "4096 MiB left" in fifth.body["detail"]
    assert client(agent, uuid, pipes[0], 2048).status in (200, 201)
    shares = agent.request("GET", "/v1/gpus/0").body["shares"]
    assert (shares["left_mib"], shares["compute_mode"]) == (4096, "DEFAULT")
    assert [h["claim"] for h in shares["holders"]] == [f"share-{n}" for n in range(4)]
    assert shares["holders"][0]["used_mib"] == 2048


def test_time_slicing_sets_and_restores_the_interval(agent: AgentProcess) -> None:
    """A TimeSlicing claim sets the GPU's time slice (Long = 3) as the simulated driver
    reports it; unpreparing it restores 0."""
    prepare(agent, "ts", {"kind": "gpu", "device": "1", "sharing": {
        "strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}})
    gpu = sim(agent)["gpus"][1]
    assert (gpu["timeslice"], gpu["compute_mode"]) == (3, "DEFAULT")
    assert agent.request("DELETE", "/v1/claims/ts").status == 204
    assert sim(agent)["gpus"][1]["timeslice"] == 0


def test_a_daemon_that_fails_to_start_leaves_nothing(agent: AgentProcess) -> None:
    """A daemon that fails to start fails the prepare 503; nothing stays held, running or
    set, and the GPU can be claimed whole at once."""
    assert agent.request("POST", "/v1/sim/faults", {
        "function": "nvidia-cuda-mps-control", "error": "cannot start"}).status in (200, 201)
    reply = agent.request("PUT", "/v1/claims/bad", {"devices": [
        {"kind": "gpu", "device": "2", "sharing": MPS_50}]})
    assert reply.status == 503 and reply.body["tool"] == "nvidia-cuda-mps-control", reply.body
    assert sim(agent)["mps_daemons"] == []
    assert sim(agent)["gpus"][2]["compute_mode"] == "DEFAULT"
    prepare(agent, "whole", {"kind": "gpu", "device": "2"})


@pytest.mark.parametrize("launcher", ["direct", "mps-host"])
def test_sigkill_of_the_agents_group_keeps_daemons_and_claims(
        tmp_path: Path, mps_root: Path, launcher: str) -> None:
    """SIGKILL of the agent's whole process group while MPS claims are prepared: after the
    restart the same daemons still run, are re-adopted (running), and no claim is lost;
    with daemons started by the agent itself (they leave its group) and by ``gpu-agent
    mps-host`` (a process of its own, as a second container runs it)."""
    state = tmp_path / "state"
    host = None
    extra: tuple[str, ...] = ()
    if launcher == "mps-host":
        extra = ("--mps-host-socket", str(tmp_path / "host.sock"))
    try:
        agent = start(state, mps_root, *extra)
        try:
            if launcher == "mps-host":
                # Its binary is the simulator's wrapper, which the agent writes as it starts.
                host = start_host(tmp_path, mps_root=mps_root, sock=tmp_path / "host.sock",
                                  mps_control=state / "sim" / "bin" / "nvidia-cuda-mps-control")
            prepare(agent, "mps", {"kind": "gpu", "device": "0", "sharing": MPS_50})
            prepare(agent, "share", {"kind": "gpu", "device": "1",
                                     "capacity": {"memory": "8Gi"}})
            before = {d["pipe_directory"]: d["pid"] for d in sim(agent)["mps_daemons"]}
            assert len(before) == 2
        finally:
            os.killpg(agent.proc.pid, signal.SIGKILL)
            agent.proc.wait(20)
        agent = start(state, mps_root, *extra)
        try:
            after = {d["pipe_directory"]: d["pid"] for d in sim(agent)["mps_daemons"]}
            assert after == before
            claims = {c["uid"]: c for c in agent.request("GET", "/v1/claims").body["claims"]}
            assert set(claims) == {"mps", "share"}
            assert {c["state"] for c in claims.values()} == {"prepare_completed"}
            assert {c["mps"]["state"] for c in claims.values()} == {"running"}
            for uid in claims:
                assert agent.request("DELETE", f"/v1/claims/{uid}").status == 204
            assert sim(agent)["mps_daemons"] == []
        finally:
            stop(agent)
    finally:
        if host is not None:
            host.stop()


def test_a_daemon_that_dies_is_reported_and_its_gpu_stays_held(agent: AgentProcess) -> None:
    """A daemon killed while its claim is prepared is reported within the supervisor's
    interval (claim mps.state failed, event claim.mps_failed); the claim keeps its GPU until
    it is unprepared, which resets the compute mode."""
    claim = prepare(agent, "dies", {"kind": "gpu", "device": "3", "sharing": MPS_50})
    daemon = daemon_at(agent, claim["mps"]["pipe_directory"])
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_for(lambda: agent.request("GET", "/v1/claims/dies").body["mps"]["state"] == "failed",
             "the daemon's death to be reported", 20, every_s=0.2)
    events = agent.request("GET", "/v1/events").body
    assert any(e["kind"] == "claim.mps_failed" for e in events["events"]), events
    busy = agent.request("PUT", "/v1/claims/other", {"devices": [{"kind": "gpu",
                                                                  "device": "3"}]})
    assert busy.status == 409
    assert agent.request("DELETE", "/v1/claims/dies").status == 204
    assert sim(agent)["gpus"][3]["compute_mode"] == "DEFAULT"
