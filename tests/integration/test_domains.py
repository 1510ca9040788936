"""The node side of a compute domain against real agents of simulated GB200 NVL72 trays, each
with its own state directory and IMEX address, and the simulated ``nvidia-imex``: a domain PUT
with every seat's address and a channel claim prepared on each node bring every daemon READY
and the domain UP, through seat names that each daemon's own /etc/hosts maps; a seat moving
to another node, or left empty, reaches the running daemons without restarting them, and a
new size restarts them; a killed daemon is restarted, a killed agent re-adopts its daemon,
the last unprepare stops it, a failing start leaves nothing held, and bad bodies change
nothing."""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.integration.test_cli import cli
from tests.waiting import wait_for

CLUSTER = "3f1f6c1e-7a55-4c52-9d0e-1b2a3c4d5e6f"
_COUNTER = itertools.count()


def _addresses(count: int) -> list[str]:
    """Addresses of this test's own: 127.0.<10 + xdist worker>.<n> (port 50000 is per
    address, and tests run in parallel)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    net = 10 + (int(worker) if worker.isdigit() else 0) % 30
    base = (next(_COUNTER) * 4) % 240 + 1
    return [f"127.0.{net}.{base + i}" for i in range(count)]


def _start(tmp_path: Path, name: str, address: str, *extra: str) -> AgentProcess:
    return start_agent(tmp_path / name, preset="gb200-nvl72", extra=[
        "--sim-cluster-uuid", CLUSTER, "--sim-clique-id", "3", "--imex-address", address,
        "--imex-ready-timeout-s", "10", *extra])


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[list[AgentProcess], list[str]]]:
    """Two trays of one clique, each with its IMEX address; their daemons stopped after."""
    peers = _addresses(2)
    agents = [_start(tmp_path, f"tray{i}", address) for i, address in enumerate(peers)]
    yield agents, peers
    for agent in agents:
        _stop_daemon(agent)
        agent.stop(signal.SIGKILL)


Trays = Callable[[str, str], AgentProcess]


@pytest.fixture
def trays(tmp_path: Path) -> Iterator[Trays]:
    """Starts trays of one clique by name and address; their daemons stopped after."""
    started: list[AgentProcess] = []

    def start(name: str, address: str) -> AgentProcess:
        started.append(_start(tmp_path, name, address))
        return started[-1]

    yield start
    for agent in started:
        _stop_daemon(agent)
        agent.stop(signal.SIGKILL)


def _stop_daemon(agent: AgentProcess) -> None:
    """Stop a test's IMEX daemon (it outlives its agent, as it must)."""
    pid = _daemon_pid(agent)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


def _daemon_pid(agent: AgentProcess) -> int | None:
    config = str(agent.state_dir.absolute() / "imex" / "config.cfg")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-c" in argv and config.encode() in argv:
            return int(entry.name)
    return None


def _daemon_hosts(agent: AgentProcess) -> dict[str, str]:
    """Name -> address as the agent's IMEX daemon resolves them: its own /etc/hosts, read
    through its mount namespace."""
    pid = _daemon_pid(agent)
    assert pid is not None, "no IMEX daemon runs"
    pairs = [line.split() for line in
             Path(f"/proc/{pid}/root/etc/hosts").read_text().splitlines()]
    return {name: address for address, name, *_ in pairs if name.startswith("imex-")}


def _channel(domain: str) -> dict[str, Any]:
    return {"devices": [{"kind": "imex-channel", "name": "channel", "domain": domain}]}


def _domain(agent: AgentProcess) -> dict[str, Any] | None:
    domains = agent.request("GET", "/v1/domains").body["domains"]
    return domains[0] if domains else None


def _up(agent: AgentProcess) -> dict[str, Any] | None:
    domain = _domain(agent)
    return domain if domain is not None and domain["state"] == "UP" else None


def test_a_domain_forms_recovers_from_kills_and_stops_with_its_last_claim(pair: Any) -> None:
    agents, peers = pair
    for agent in agents:
        put = agent.request("PUT", "/v1/domains/job-1", {"peers": peers})
        assert put.status == 200, put.body
        assert put.body["daemon"]["state"] == "stopped"
        again = agent.request("PUT", "/v1/domains/job-1", {"peers": peers})
        assert again.status == 200 and again.body["peers"] == peers
    node = agents[0].request("GET", "/v1/node").body
    assert node["imex"] == {"address": peers[0], "port": 50000}

    for i, agent in enumerate(agents):
        prepared = agent.request("PUT", f"/v1/claims/claim-{i}", _channel("job-1"))
        assert prepared.status == 200, prepared.body
        [device] = prepared.body["devices"]
        assert (device["kind"], device["domain"], device["channel"]) == \
            ("imex-channel", "job-1", 0)
        assert device["cdi_devices"] == [
            f"k8s.gpu.nodeagent.dev/claim=claim-{i}-imex-channel-0"]
    for agent in agents:
        domain = wait_for(lambda a=agent: _up(a), "the domain to be UP", 20)
        assert [n["status"] for n in domain["nodes"]] == ["READY", "READY"]
        assert domain["daemon"]["state"] == "running"
        assert domain["holders"] == [f"claim-{agents.index(agent)}"]
    # Each GPU of a member shows its domain beside its fabric and clique.
    gpus = agents[0].request("GET", "/v1/gpus").body["gpus"]
    assert {g["domain"] for g in gpus} == {"job-1"}
    wide = cli("gpus", "-o", "wide", "--url", agents[0].url)
    header_line, *rows = wide.stdout.splitlines()
    assert " DOMAIN " in header_line and all(" job-1 " in row for row in rows[:4]), wide.stdout
    listed = cli("domains", "--url", agents[0].url)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["DOMAIN", "STATE", "DAEMON", "PID", "READY", "CLAIMS", "ADDRESS"]
    assert row.split()[:3] == ["job-1", "UP", "running"] and row.split()[4:] == [
        "2/2", "1", peers[0]]
    shown = cli("domains", "job-1", "-o", "json", "--url", agents[0].url)
    assert json.loads(shown.stdout)["holders"] == ["claim-0"]
    spec = next(s for s in agents[0].request("GET", "/v1/cdi").body["specs"]
                if "claim-0-imex-channel-0" in " ".join(s["devices"]))
    assert spec["devices"] == ["k8s.gpu.nodeagent.dev/claim=claim-0-imex-channel-0"]
    [written] = json.loads(Path(spec["path"]).read_text())["devices"]
    assert written["containerEdits"]["deviceNodes"] == [{
        "path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 507,
        "minor": 0}]

    # A second claim of the same domain shares the channel; another domain is refused.
    shared = agents[0].request("PUT", "/v1/claims/claim-0b", _channel("job-1"))
    assert shared.status == 200, shared.body
    other = agents[0].request("PUT", "/v1/claims/claim-x", _channel("job-2"))
    assert other.status == 409 and other.body["type"].endswith("/domain-busy"), other.body
    assert other.body["domain"] == "job-1"
    busy = agents[0].request("PUT", "/v1/domains/job-2", {"peers": peers})
    assert busy.status == 409 and busy.body["domain"] == "job-1"

    # One node's IMEX daemon killed: its agent restarts it and the domain comes back UP.
    first = _domain(agents[1])
    assert first is not None
    os.kill(first["daemon"]["pid"], signal.SIGKILL)
    back = wait_for(lambda: (d := _up(agents[1])) and d["daemon"]["pid"] !=
                    first["daemon"]["pid"] and d, "the daemon restarted and the domain UP", 30)
    assert back["daemon"]["state"] == "running"
    restarts = agents[1].request("GET", "/metrics", token=None).body
    assert "gpu_agent_imex_daemon_restarts_total 1.0" in restarts
    kinds = [e["kind"] for e in agents[1].request("GET", "/v1/events").body["events"]]
    assert "domain.daemon_restarted" in kinds

    # The agent killed: on restart it re-adopts the running daemon; the claim stays prepared.
    pid = back["daemon"]["pid"]
    agents[1].stop(signal.SIGKILL)
    agents[1] = start_agent(agents[1].state_dir, preset="gb200-nvl72", extra=[
        "--sim-cluster-uuid", CLUSTER, "--sim-clique-id", "3", "--imex-address", peers[1]])
    adopted = wait_for(lambda: _up(agents[1]), "the domain UP after the restart", 20)
    assert adopted["daemon"]["pid"] == pid
    assert agents[1].request("GET", "/v1/claims/claim-1").body["state"] == "prepare_completed"

    # Unprepare: other holders keep it running, the last one stops it and leaves the domain.
    assert agents[0].request("DELETE", "/v1/claims/claim-0").status == 204
    assert _domain(agents[0])["daemon"]["state"] == "running"  # type: ignore[index]
    pid0 = _daemon_pid(agents[0])
    assert agents[0].request("DELETE", "/v1/claims/claim-0b").status == 204
    assert agents[0].request("GET", "/v1/domains").body == {"domains": []}
    assert pid0 is not None and _daemon_pid(agents[0]) is None
    assert not (agents[0].state_dir / "imex" / "config.cfg").exists()


def _prepare(agents: list[AgentProcess], peers: list[str | None], domain: str) -> None:
    for agent in agents:
        put = agent.request("PUT", f"/v1/domains/{domain}", {"peers": peers})
        assert put.status == 200, put.body
        claim = f"claim-{agent.state_dir.name}"
        prepared = agent.request("PUT", f"/v1/claims/{claim}", _channel(domain))
        assert prepared.status == 200, prepared.body


def _configured(agent: AgentProcess) -> list[dict[str, Any]]:
    return [e["details"] for e in agent.request("GET", "/v1/events").body["events"]
            if e["kind"] == "domain.configured"]


def test_seats_move_to_other_nodes_without_restarting_the_healthy_daemons(
        trays: Trays) -> None:
    a, b, c, d = _addresses(4)
    members = [trays("tray0", a), trays("tray1", b), trays("tray2", c)]
    _prepare(members, [a, b, c], "job")
    for agent in members:
        wait_for(lambda agent=agent: _up(agent), "the domain UP through the seat names", 30)
    first = _domain(members[0])
    assert first is not None
    names = first["names"]
    assert len(set(names)) == 3 and all(n.startswith("imex-") for n in names)
    for agent in members:
        # The node list holds only the names; each daemon's own /etc/hosts maps them.
        assert (agent.state_dir / "imex" / "nodes_config.cfg").read_text().split() == names
        assert _daemon_hosts(agent) == dict(zip(names, [a, b, c], strict=True))
        assert [n["host"] for n in _domain(agent)["nodes"]] == names  # type: ignore[index]
    assert Path("/etc/hosts").read_text().count("imex-") == 0  # the node's is untouched
    shown = cli("domains", "job", "--url", members[0].url)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[:3] for line in shown.stdout.splitlines() if "imex-" in line] == [
        [str(seat), name, address] for seat, (name, address) in
        enumerate(zip(names, [a, b, c], strict=True))]

    # Seat 2's pod moves from tray2 to tray3: tray2 unprepares, the others get its address.
    old_pids = [_daemon_pid(agent) for agent in members[:2]]
    assert members[2].request("DELETE", "/v1/claims/claim-tray2").status == 204
    assert _daemon_pid(members[2]) is None
    moved = trays("tray3", d)
    _prepare([*members[:2], moved], [a, b, d], "job")
    healthy = [*members[:2], moved]
    for agent in healthy:
        wait_for(lambda agent=agent: _up(agent), "the domain UP with tray3 in seat 2", 30)
    assert [_daemon_pid(agent) for agent in members[:2]] == old_pids  # not restarted
    for agent in healthy:
        assert _daemon_hosts(agent) == dict(zip(names, [a, b, d], strict=True))
    for agent in members[:2]:
        assert _configured(agent)[-1]["restarted"] is False
        assert _configured(agent)[-1]["reconnected"] is True
        metrics = agent.request("GET", "/metrics", token=None).body
        assert "gpu_agent_imex_reconnects_total 1.0" in metrics
        log = (agent.state_dir / "imex" / "nvidia-imex.log").read_text()
        assert "SIGUSR1: restarting outgoing connections" in log

    # Seat 1 left empty (tray1's pod gone, none in its place): degraded, nothing restarted.
    assert members[1].request("DELETE", "/v1/claims/claim-tray1").status == 204
    left = [members[0], moved]
    pids = [_daemon_pid(agent) for agent in left]
    for agent in left:
        put = agent.request("PUT", "/v1/domains/job", {"peers": [a, None, d]})
        assert put.status == 200 and put.body["peers"] == [a, None, d], put.body
    for agent in left:
        degraded = wait_for(lambda agent=agent: (dom := _domain(agent)) and [
            n["status"] for n in dom["nodes"]] == ["READY", "UNAVAILABLE", "READY"] and dom,
            "seat 1 UNAVAILABLE", 30)
        assert degraded["state"] == "DEGRADED"
        assert _daemon_hosts(agent) == {names[0]: a, names[2]: d}
    assert [_daemon_pid(agent) for agent in left] == pids


def test_a_failing_imex_start_fails_the_prepare_and_holds_nothing(tmp_path: Path) -> None:
    [address] = _addresses(1)
    agent = _start(tmp_path, "tray", address)
    try:
        assert agent.request("PUT", "/v1/domains/job", {"peers": [address]}).status == 200
        fault = agent.request("POST", "/v1/sim/faults", {
            "function": "nvidia-imex", "error": "kernel driver version mismatch"})
        assert fault.status == 201, fault.body
        failed = agent.request("PUT", "/v1/claims/c1", _channel("job"))
        assert failed.status == 503, failed.body
        assert failed.body["type"].endswith("/imex-unavailable")
        assert "kernel driver version mismatch" in failed.body["detail"]
        assert agent.request("GET", "/v1/claims").body["claims"] == []
        # No spec names the claim (a bare "c1" would match GPU UUIDs of the node's spec).
        assert not any(d.startswith("k8s.gpu.nodeagent.dev/claim=c1-")
                       for s in agent.request("GET", "/v1/cdi").body["specs"]
                       for d in s["devices"])
        domain = _domain(agent)
        assert domain is not None and domain["holders"] == [] and \
            domain["daemon"]["state"] == "failed"
        assert _daemon_pid(agent) is None
        # The fault was one start: a retry prepares.
        retried = agent.request("PUT", "/v1/claims/c1", _channel("job"))
        assert retried.status == 200, retried.body
    finally:
        _stop_daemon(agent)
        agent.stop(signal.SIGKILL)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/domains/job", {"peers": []}, "peers"),
    ("/v1/domains/job", {"peers": ["127.0.0.250"]}, "peers"),
    ("/v1/domains/job", {"peers": ["SELF", "SELF"]}, "peers[1]"),
    ("/v1/domains/job", {"peers": ["SELF", "not a host!"]}, "peers[1]"),
    ("/v1/domains/job", {"peers": [None, "SELF", "tray-3.example.org"]}, "peers[2]"),
    ("/v1/domains/job", {"peers": [None]}, "peers"),
    ("/v1/domains/job", {"peers": ["SELF"], "extra": 1}, "extra"),
    ("/v1/domains/-bad", {"peers": ["SELF"]}, "domain"),
    ("/v1/claims/c", {"devices": [{"kind": "imex-channel"}]}, "devices[0]"),
    ("/v1/claims/c", {"devices": [{"kind": "imex-channel", "domain": "job",
                                   "device": "gpu-0"}]}, "devices[0]"),
])
def test_bad_bodies_are_refused_naming_the_field(tmp_path: Path, path: str, body: Any,
                                                 field: str) -> None:
    [address] = _addresses(1)
    agent = _start(tmp_path, "tray", address)
    try:
        if "peers" in body:
            body = {**body, "peers": [address if p == "SELF" else p for p in body["peers"]]}
        refused = agent.request("PUT", path, body)
        assert refused.status == 422, refused.body
        assert any(e["field"].startswith(field) for e in refused.body["errors"]), refused.body
        assert agent.request("GET", "/v1/domains").body == {"domains": []}
    finally:
        agent.stop(signal.SIGKILL)


def test_without_an_imex_address_domain_calls_say_what_to_set(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "tray", preset="gb200-nvl72")
    try:
        refused = agent.request("PUT", "/v1/domains/job", {"peers": ["127.0.0.1"]})
        assert refused.status == 409 and refused.body["type"].endswith("/imex-not-configured")
        assert "--imex-address" in refused.body["detail"]
        assert agent.request("GET", "/v1/node").body["imex"] is None
    finally:
        agent.stop(signal.SIGKILL)


def test_a_new_size_restarts_a_running_daemon_once_with_it(tmp_path: Path) -> None:
    me, other = _addresses(2)
    agent = _start(tmp_path, "tray", me)
    try:
        assert agent.request("PUT", "/v1/domains/job", {"peers": [me]}).status == 200
        assert agent.request("PUT", "/v1/claims/c1", _channel("job")).status == 200
        before = wait_for(lambda: _up(agent), "a one-node domain UP", 20)
        changed = agent.request("PUT", "/v1/domains/job", {"peers": [other, me]})
        assert changed.status == 200, changed.body
        assert changed.body["peers"] == [other, me]
        names = changed.body["names"]
        assert (agent.state_dir / "imex" / "nodes_config.cfg").read_text() == \
            f"{names[0]}\n{names[1]}\n"
        assert _daemon_hosts(agent) == {names[0]: other, names[1]: me}
        after = _domain(agent)
        assert after is not None and after["daemon"]["pid"] not in (None,
                                                                     before["daemon"]["pid"])
        seen = wait_for(lambda: (d := _domain(agent)) and len(d["nodes"]) == 2 and d,
                        "the daemon to see both nodes", 20)
        assert [(n["host"], n["status"]) for n in seen["nodes"]] == [
            (names[0], "UNAVAILABLE"), (names[1], "READY")]
        assert seen["state"] == "DEGRADED"
        configured = [e for e in agent.request("GET", "/v1/events").body["events"]
                      if e["kind"] == "domain.configured"]
        assert [(e["details"]["restarted"], e["details"]["reconnected"])
                for e in configured] == [(False, False), (True, False)]
    finally:
        _stop_daemon(agent)
        agent.stop(signal.SIGKILL)


def test_unreadable_domain_state_fails_closed_until_an_operator_accepts(
        tmp_path: Path) -> None:
    [address] = _addresses(1)
    state = tmp_path / "tray"
    (state / "imex").mkdir(parents=True)
    (state / "imex" / "domain.json").write_text("{not json")
    agent = _start(tmp_path, "tray", address)
    try:
        for method, path, body in (("GET", "/v1/domains", None),
                                   ("PUT", "/v1/domains/job", {"peers": [address]}),
                                   ("PUT", "/v1/claims/c1", _channel("job"))):
            refused = agent.request(method, path, body)
            assert refused.status == 503, (path, refused.body)
            assert refused.body["type"].endswith("/state-unreadable")
            assert "POST /v1/admin/domain-state" in refused.body["detail"]
        agent.stop(signal.SIGKILL)
        agent = _start(tmp_path, "tray", address)  # a restart does not forget it
        assert agent.request("GET", "/v1/domains").status == 503
        accepted = agent.request("POST", "/v1/admin/domain-state")
        assert accepted.status == 200, accepted.body
        assert agent.request("GET", "/v1/domains").body == {"domains": []}
        assert agent.request("PUT", "/v1/domains/job", {"peers": [address]}).status == 200
        again = agent.request("POST", "/v1/admin/domain-state")
        assert again.status == 409
    finally:
        agent.stop(signal.SIGKILL)
