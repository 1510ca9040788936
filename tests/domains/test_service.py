"""The domain service against fake IMEX tools (daemons as pids in a table): one domain at a
time, the daemon started once for its first holder and stopped after its last, re-adopted
or restarted at start-up and by supervision, and every refusal before anything changes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.domains.service import CHANNEL_KEY, DomainService, ImexSettings
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

ME, OTHER = "10.0.0.5", "10.0.0.6"


class FakeImex:
    """Daemons by pid, each with the config it runs; a start may be made to fail, and a
    daemon may stay short of READY."""

    def __init__(self) -> None:
        self.running: dict[int, Path] = {}
        self.pids = itertools.count(1000)
        self.starts = 0
        self.fail: str | None = None
        self.ready = True

    async def start(self, config: Path) -> None:
        self.starts += 1
        if self.fail is not None:
            raise ImexUnavailable(f"nvidia-imex: {self.fail}", reason="start failed")
        self.running[next(self.pids)] = config

    async def state(self, config: Path) -> str | None:
        if config not in self.running.values():
            return None
        return "READY" if self.ready else "WAITING_FOR_PEERS"

    async def domain(self, config: Path) -> ImexDomainView | None:
        if config not in self.running.values():
            return None
        return ImexDomainView("UP", (ImexNode(0, ME, "READY"),))

    def find(self, config: Path) -> int | None:
        return next((pid for pid, c in self.running.items() if c == config), None)

    def runs(self, pid: int, config: Path) -> bool:
        return self.running.get(pid) == config

    async def stop(self, pid: int, config: Path, *, timeout_s: float = 10.0) -> None:
        if self.running.get(pid) == config:
            del self.running[pid]


class Node:
    """One node's ledger, metrics and domain service over a state directory."""

    def __init__(self, tmp_path: Path, tools: FakeImex, *, address: str | None = ME) -> None:
        self.events = EventLog()
        self.ledger = NodeLedger(quarantine_path=tmp_path / "quarantine.json",
                                 events=self.events)
        self.metrics = AgentMetrics(process=False)
        self.service = DomainService(
            settings=ImexSettings(address=address, ready_timeout_s=0.3),
            directory=tmp_path / "imex", control=tools, ledger=self.ledger,
            events=self.events, metrics=self.metrics)

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
    assert (tmp_path / "imex" / "nodes_config.cfg").read_text() == f"{OTHER}\n{ME}\n"

    node.ledger.release("c1")
    await node.service.released("job", leave=True)
    assert len(tools.running) == 1 and node.service.domain is not None
    node.ledger.release("c2")
    await node.service.released("job", leave=True)
    assert tools.running == {} and node.service.domain is None
    assert not (tmp_path / "imex" / "config.cfg").exists()
    assert node.kinds() == ["domain.configured", "domain.daemon_started", "domain.left"]
    assert node.metric("gpu_agent_imex_daemon_up") == 0


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


async def test_the_same_peers_again_change_nothing_and_new_ones_restart_once(
        tmp_path: Path, tools: FakeImex) -> None:
    node = await _member(tmp_path, tools)
    _, changed = await node.service.configure("job", [OTHER, ME])
    assert not changed and tools.starts == 0  # not running: nothing to restart
    node.service.reserve("c1", "job")
    await node.service.ready("job")
    first = set(tools.running)
    _, changed = await node.service.configure("job", [ME, OTHER])
    assert changed and tools.starts == 2 and set(tools.running).isdisjoint(first)
    assert (tmp_path / "imex" / "nodes_config.cfg").read_text() == f"{ME}\n{OTHER}\n"


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
