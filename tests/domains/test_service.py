"""The domain service against fake IMEX tools (daemons as pids in a table): one domain at a
time, the daemon started once for its first holder and stopped after its last, re-adopted
or restarted at start-up and by supervision, a seat's new address reaching a running daemon
through its hosts file and a SIGUSR1 (coalesced to IMEX's window) without a restart, and
every refusal before anything changes."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from agent.domains.config import render_hosts, render_nodes, seat_names
from agent.domains.service import (
    CHANNEL_KEY,
    RECONNECT_WINDOW_S,
    DomainService,
    ImexSettings,
    next_signal,
)
from agent.durable import DurableMap
from agent.errors import (
    DomainBusy,
    DomainUnknown,
    ImexNotConfigured,
    ImexUnavailable,
    InvalidRequest,
)
from agent.events import EventLog
from agent.gpu.imex import ImexDomainView, ImexNode
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics

ME, OTHER, THIRD = "10.0.0.5", "10.0.0.6", "10.0.0.7"


class FakeImex:
    """Daemons by pid, each with the config it runs and the inode of the hosts file bound
    at its /etc/hosts; the SIGUSR1s each got; a start may be made to fail, and a daemon may
    stay short of READY."""

    def __init__(self) -> None:
        self.running: dict[int, Path] = {}
        self.bound: dict[int, int] = {}
        self.signals: list[int] = []
        self.pids = itertools.count(1000)
        self.starts = 0
        self.fail: str | None = None
        self.ready = True
        #: nvidia-imex-ctl runs (-q and -N -j each count one).
        self.queries = 0
        self.status = "UP"

    async def start(self, config: Path, hosts: Path) -> None:
        self.starts += 1
        if self.fail is not None:
            raise ImexUnavailable(f"nvidia-imex: {self.fail}", reason="start failed")
        pid = next(self.pids)
        self.running[pid] = config
        self.bound[pid] = os.stat(hosts).st_ino

    def reconnect(self, pid: int, config: Path) -> bool:
        if self.running.get(pid) != config:
            return False
        self.signals.append(pid)
        return True

    async def state(self, config: Path) -> str | None:
        self.queries += 1
        if config not in self.running.values():
            return None
        return "READY" if self.ready else "WAITING_FOR_PEERS"

    async def domain(self, config: Path) -> ImexDomainView | None:
        self.queries += 1
        if config not in self.running.values():
            return None
        return ImexDomainView(self.status, (ImexNode(0, ME, "READY"),))

    def find(self, config: Path) -> int | None:
        return next((pid for pid, c in self.running.items() if c == config), None)

    def runs(self, pid: int, config: Path) -> bool:
        return self.running.get(pid) == config

    async def stop(self, pid: int, config: Path, *, timeout_s: float = 10.0) -> None:
        if self.running.get(pid) == config:
            del self.running[pid]


class Clock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """One node's ledger, metrics and domain service over a state directory."""

    def __init__(self, tmp_path: Path, tools: FakeImex, *, address: str | None = ME,
                 clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.events = EventLog()
        self.ledger = NodeLedger(quarantine_path=tmp_path / "quarantine.json",
                                 events=self.events)
        self.metrics = AgentMetrics(process=False)
        self.service = DomainService(
            settings=ImexSettings(address=address, ready_timeout_s=0.3),
            directory=tmp_path / "imex", control=tools, ledger=self.ledger,
            events=self.events, metrics=self.metrics, clock=self.clock)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events.after(0, None).events]

    def metric(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)


@pytest.fixture
def tools() -> FakeImex:
    return FakeImex()


async def _member(tmp_path: Path, tools: FakeImex) -> Node:
    node = Node(tmp_path, tools)
    await node.service.recover()
    await node.service.configure("job", [OTHER, ME])
    return node


async def test_the_first_holder_starts_the_daemon_and_the_last_stops_it(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    for uid in ("c1", "c2"):
        node.service.reserve(uid, "job")
        await node.service.ready("job")
    assert tools.starts == 1 and len(tools.running) == 1
    assert node.service.holders() == ("c1", "c2")
    [view] = await node.service.views()
    assert (view.daemon.state, view.daemon.imex_state, view.imex and view.imex.status) == \
        ("running", "READY", "UP")
    names = seat_names("job", 2)
    assert view.domain.names == names
    assert (tmp_path / "imex" / "nodes_config.cfg").read_text() == render_nodes(names)
    assert (tmp_path / "imex" / "hosts").read_text() == render_hosts(names, [OTHER, ME])

    node.ledger.release("c1")
    await node.service.released("job", leave=True)
    assert len(tools.running) == 1 and node.service.domain is not None
    node.ledger.release("c2")
    await node.service.released("job", leave=True)
    assert tools.running == {} and node.service.domain is None
    assert not (tmp_path / "imex" / "config.cfg").exists()
    assert not (tmp_path / "imex" / "hosts").exists()
    assert node.kinds() == ["domain.configured", "domain.daemon_started", "domain.left"]
    assert node.metric("gpu_agent_imex_daemon_up") == 0


async def test_views_are_served_from_the_last_supervision_round(tmp_path: Path,
                                                                 tools: FakeImex) -> None:
    """A GET runs no nvidia-imex-ctl while supervision keeps a reading of the running
    daemon; the next round's reading is what the GET after it shows, and a seat change or a
    new daemon is read afresh."""
    node = await _member(tmp_path, tools)
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    await node.service.check()
    before = tools.queries
    for _ in range(3):
        [view] = await node.service.views()
        assert view.imex is not None and view.imex.status == "UP"
    assert tools.queries == before
    tools.status = "DEGRADED"
    [view] = await node.service.views()
    assert view.imex is not None and view.imex.status == "UP"  # until the next round
    await node.service.check()
    [view] = await node.service.views()
    assert view.imex is not None and view.imex.status == "DEGRADED"
    before = tools.queries
    await node.service.configure("job", [THIRD, ME])  # a seat moves: read again at once
    assert tools.queries == before + 2


async def test_refusals_change_nothing(tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    with pytest.raises(DomainBusy) as busy:
        await node.service.configure("other", [ME])
    assert busy.value.domain == "job"
    with pytest.raises(InvalidRequest) as bad:
        await node.service.configure("job", [OTHER])
    assert [e["field"] for e in bad.value.errors] == ["peers"]
    with pytest.raises(DomainBusy):
        node.service.reserve("c1", "other")
    assert node.service.domain is not None and node.service.domain.peers == (OTHER, ME)
    assert node.ledger.holders(CHANNEL_KEY) == ()

    alone = Node(tmp_path / "b", tools)
    await alone.service.recover()
    with pytest.raises(DomainUnknown):
        alone.service.reserve("c1", "job")
    unconfigured = Node(tmp_path / "c", tools, address=None)
    with pytest.raises(ImexNotConfigured) as unset:
        await unconfigured.service.configure("job", [ME])
    assert "--imex-address" in unset.value.detail


@pytest.mark.parametrize(("last", "now", "pending", "due"), [
    (None, 10.0, False, None),  # nothing to send
    (None, 10.0, True, 10.0),  # none sent to this daemon yet: at once
    (3.0, 10.0, True, 10.0),  # the last one a window old: at once
    (3.0, 10.0, False, None),
    (8.0, 10.0, True, 8.0 + RECONNECT_WINDOW_S),  # inside the window: once it passed
    (10.0, 10.0, True, 10.0 + RECONNECT_WINDOW_S),  # adopted just now: possibly recent
])
def test_a_sigusr1_goes_when_imex_takes_it(last: float | None, now: float, pending: bool,
                                           due: float | None) -> None:
    assert next_signal(last, now, pending=pending) == due


def _state(tmp_path: Path) -> DurableMap:
    """The domain state file as another agent (an earlier one) writes it."""
    return DurableMap(tmp_path / "imex" / "domain.json", format="gpu-agent-imex-domain")


async def _running(tmp_path: Path, tools: FakeImex, peers: list[str | None]) -> Node:
    node = Node(tmp_path, tools)
    await node.service.recover()
    await node.service.configure("job", peers)
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    return node


def _configured(node: Node) -> list[dict[str, object]]:
    return [e.details for e in node.events.after(0, None).events
            if e.kind == "domain.configured"]


async def test_the_same_peers_again_change_nothing_and_a_new_size_restarts_once(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    _, changed = await node.service.configure("job", [OTHER, ME])
    assert not changed and tools.starts == 0  # not running: nothing to restart
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    first = set(tools.running)
    third = "10.0.0.7"
    _, changed = await node.service.configure("job", [ME, OTHER, third])
    assert changed and tools.starts == 2 and set(tools.running).isdisjoint(first)
    names = seat_names("job", 3)
    assert (tmp_path / "imex" / "nodes_config.cfg").read_text() == render_nodes(names)
    assert (tmp_path / "imex" / "hosts").read_text() == render_hosts(names, [ME, OTHER, third])
    assert [(d["restarted"], d["reconnected"]) for d in _configured(node)] == [
        (False, False), (True, False)]
    assert tools.signals == []


async def test_a_seat_moving_to_another_address_rewrites_the_hosts_file_and_signals(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _running(tmp_path, tools, [OTHER, ME, "10.0.0.7"])
    [pid] = tools.running
    hosts = tmp_path / "imex" / "hosts"
    nodes = (tmp_path / "imex" / "nodes_config.cfg").read_text()
    view, changed = await node.service.configure("job", ["10.0.0.8", ME, "10.0.0.7"])
    assert changed and list(tools.running) == [pid] and tools.starts == 1
    assert view.daemon.pid == pid
    names = seat_names("job", 3)
    # The daemon's bind mount pins the inode: the file was rewritten, never replaced.
    assert hosts.stat().st_ino == tools.bound[pid]
    assert hosts.read_text() == render_hosts(names, ["10.0.0.8", ME, "10.0.0.7"])
    assert (tmp_path / "imex" / "nodes_config.cfg").read_text() == nodes
    assert tools.signals == [pid]
    assert _configured(node)[-1]["restarted"] is False
    assert _configured(node)[-1]["reconnected"] is True
    assert "domain.daemon_reconnected" in node.kinds()
    assert node.metric("gpu_agent_imex_reconnects_total") == 1

    # A seat left empty: its line goes, the daemon is told; still no restart.
    await node.service.configure("job", ["10.0.0.8", ME, None])
    assert list(tools.running) == [pid] and hosts.stat().st_ino == tools.bound[pid]
    assert "10.0.0.7" not in hosts.read_text() and names[2] not in hosts.read_text()
    assert node.service.domain is not None and node.service.domain.peers == (
        "10.0.0.8", ME, None)


async def test_changes_inside_the_sigusr1_window_reach_the_daemon_once_it_passed(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _running(tmp_path, tools, [OTHER, ME])
    [pid] = tools.running
    await node.service.configure("job", ["10.0.0.8", ME])
    assert tools.signals == [pid]
    node.clock.now += 1
    await node.service.configure("job", ["10.0.0.9", ME])
    node.clock.now += 1
    await node.service.configure("job", [None, ME])
    assert tools.signals == [pid]  # IMEX would ignore it now
    assert node.service.next_check_s(10.0) == pytest.approx(RECONNECT_WINDOW_S - 2)
    await node.service.check()
    assert tools.signals == [pid]
    node.clock.now += RECONNECT_WINDOW_S - 2
    await node.service.check()
    assert tools.signals == [pid, pid]  # once, for the last of the changes
    node.clock.now += 60
    await node.service.check()
    assert tools.signals == [pid, pid] and node.service.next_check_s(2.0) == 2.0
    assert node.metric("gpu_agent_imex_reconnects_total") == 2


async def test_an_adopted_daemon_gets_a_pending_signal_only_after_a_window(
        tmp_path: Path, tools: FakeImex) -> None:
    await _running(tmp_path, tools, [OTHER, ME])
    [pid] = tools.running
    hosts = tmp_path / "imex" / "hosts"
    # The agent stored the change and died before the hosts file and the signal.
    await _state(tmp_path).set("domain", {"id": "job", "peers": ["10.0.0.8", ME], "pid": pid,
                                          "reconnect": True})

    again = Node(tmp_path, tools)  # its last signal unknown: possibly just now
    again.service.hold("c1")
    await again.service.recover()
    assert list(tools.running) == [pid] and "domain.daemon_adopted" in again.kinds()
    assert hosts.read_text() == render_hosts(seat_names("job", 2), ["10.0.0.8", ME])
    assert hosts.stat().st_ino == tools.bound[pid]
    await again.service.check()
    assert tools.signals == []
    again.clock.now += RECONNECT_WINDOW_S
    await again.service.check()
    assert tools.signals == [pid]


async def test_a_daemon_of_an_older_agent_listing_addresses_restarts_on_a_change(
        tmp_path: Path, tools: FakeImex) -> None:
    """State and files of an agent that wrote addresses into the node list: they load, and
    the first change restarts the daemon with seat names."""
    directory = tmp_path / "imex"
    directory.mkdir()
    (directory / "nodes_config.cfg").write_text(f"{OTHER}\n{ME}\n")
    pid = 4242
    tools.running[pid] = directory / "config.cfg"
    await _state(tmp_path).set("domain", {"id": "job", "peers": [OTHER, ME], "pid": pid})
    node = Node(tmp_path, tools)
    node.service.hold("c1")
    await node.service.recover()
    assert node.service.domain is not None and node.service.domain.peers == (OTHER, ME)
    assert list(tools.running) == [pid]
    await node.service.configure("job", ["10.0.0.8", ME])
    assert pid not in tools.running and tools.starts == 1 and tools.signals == []
    assert (directory / "nodes_config.cfg").read_text() == render_nodes(seat_names("job", 2))


async def test_a_daemon_short_of_ready_fails_the_wait_naming_its_state(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    tools.ready = False
    node.service.reserve("c1", "job")
    with pytest.raises(ImexUnavailable) as late:
        await node.service.ready("job")
    assert late.value.reason == "not ready" and "WAITING_FOR_PEERS" in late.value.detail
    node.ledger.release("c1")
    await node.service.released("job", leave=False)
    assert tools.running == {} and node.service.domain is not None  # kept for a retry


async def test_start_up_adopts_a_live_daemon_restarts_a_dead_one_and_stops_an_unheld_one(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    [pid] = tools.running

    again = Node(tmp_path, tools)  # the agent restarted: the holds come from the checkpoint
    again.service.hold("c1")
    await again.service.recover()
    assert list(tools.running) == [pid] and "domain.daemon_adopted" in again.kinds()

    tools.running.clear()  # the daemon died with the agent down
    third = Node(tmp_path, tools)
    third.service.hold("c1")
    await third.service.recover()
    assert len(tools.running) == 1 and "domain.daemon_restarted" in third.kinds()
    assert third.metric("gpu_agent_imex_daemon_restarts_total") == 1

    unheld = Node(tmp_path, tools)  # its last claim went while the agent was down
    await unheld.service.recover()
    assert tools.running == {} and unheld.service.domain is None


async def test_supervision_restarts_a_dead_daemon_and_reports_a_failing_restart_once(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    await node.service.check()
    assert node.metrics.registry.get_sample_value("gpu_agent_imex_domain_nodes",
                                                  {"state": "READY"}) == 1
    tools.running.clear()
    await node.service.check()
    assert len(tools.running) == 1 and node.metric("gpu_agent_imex_daemon_restarts_total") == 1

    tools.running.clear()
    tools.fail = "kernel driver mismatch"
    await node.service.check()
    await node.service.check()
    failed = [e for e in node.events.after(0, None).events if e.kind == "domain.daemon_failed"]
    assert len(failed) == 1 and "kernel driver mismatch" in failed[0].message
    [view] = await node.service.views()
    assert view.daemon.state == "failed" and "kernel driver mismatch" in (view.daemon.reason
                                                                           or "")
    tools.fail = None
    await node.service.check()
    assert len(tools.running) == 1


async def test_a_domain_no_claim_holds_can_be_left_and_one_held_cannot(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    with pytest.raises(DomainBusy) as held:
        await node.service.leave("job")
    assert held.value.holders == ("c1",) and len(tools.running) == 1
    node.ledger.release("c1")  # say, lost in a reboot and unprepared by hand
    assert await node.service.leave("job") is True
    assert tools.running == {} and node.service.domain is None
    assert await node.service.leave("job") is False
    await node.service.configure("next-job", [ME])
