"""The MIG transition history (issue 15, "keep a bounded event and transition history across
restarts"): finished transitions are kept in ``<state>/mig/transitions.json`` (the durable
envelope), bounded in count and bytes, shown again by ``GET /v1/transitions`` after a
restart, and an unreadable file never stops the agent."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from agent.api.mig_models import TransitionModel
from agent.durable import decode_envelope, dump_payload, write_durable
from agent.mig.geometry import DesiredProfiles, Plan
from agent.mig.history import HISTORY_KIND, MAX_HISTORY_BYTES, TransitionHistory
from agent.mig.transition import DrainPolicy, Transition, TransitionState
from tests.agent_process import AgentProcess, start_agent
from tests.service_node import ServiceNode, open_services
from tests.waiting import wait_for

EMPTY_PLAN = Plan(keep=(), destroy=(), create=(), mig_enabled_before=False,
                  mig_enabled_after=True)


def _shown(node: ServiceNode) -> list[dict[str, Any]]:
    return [TransitionModel.of(t).model_dump() for t in node.mig.transitions()]


def _on_disk(path: Path) -> list[dict[str, Any]]:
    transitions: list[dict[str, Any]] = decode_envelope(path.read_bytes(),
                                                        HISTORY_KIND).payload["transitions"]
    return transitions


async def _change(node: ServiceNode, index: int, profiles: list[str]) -> Transition:
    outcome = await node.mig.request(await node.gpu(index), DesiredProfiles.of(profiles),
                                     DrainPolicy())
    assert outcome.transition is not None
    await asyncio.wait_for(outcome.transition.finished.wait(), 30)
    return outcome.transition


async def test_finished_transitions_are_shown_the_same_after_a_restart(tmp_path: Path) -> None:
    """A succeeded and a rolled-back transition read the same (states, steps, timings, plan,
    error) after the agent restarts on the same state directory."""
    node = await open_services(tmp_path)
    try:
        assert (await _change(node, 1, ["3g.40gb"])).state == TransitionState.SUCCEEDED
        node.sim.add_fault("nvmlGpuInstanceCreateComputeInstance", "NVML_ERROR_UNKNOWN")
        failed = await _change(node, 2, ["1g.10gb"])
        node.sim.clear_faults()
        assert failed.state == TransitionState.ROLLED_BACK and failed.error
        before = _shown(node)
    finally:
        await node.close()
    assert [t["id"] for t in _on_disk(tmp_path / "state" / "mig" / "transitions.json")] == \
        [t["id"] for t in reversed(before)]
    node = await open_services(tmp_path)
    try:
        assert _shown(node) == before
        assert node.mig.transition(before[0]["id"]).state == TransitionState.ROLLED_BACK
        after = await _change(node, 3, ["7g.80gb"])
        assert [t["id"] for t in _shown(node)] == [after.id] + [t["id"] for t in before]
    finally:
        await node.close()


def _finished(n: int, requested: str = "test") -> Transition:
    t = Transition(id=f"t{n}", gpu="GPU-x", gpu_index=0, requested=requested,
                   plan=EMPTY_PLAN, drain=DrainPolicy("wait", 2.5), created_at=1000.0 + n)
    t.advance(TransitionState.SUCCEEDED)
    return t


#: Each case: transitions finished (count, size of each one's ``requested``), the count kept.
BOUNDS = {
    "at most capacity transitions, the newest": (7, 10, 4),
    "under capacity, every one": (3, 10, 3),
    "at most MAX_HISTORY_BYTES on disk, the newest": (4, MAX_HISTORY_BYTES // 3, 2),
}


@pytest.mark.parametrize(("count", "size", "kept"), BOUNDS.values(), ids=BOUNDS.keys())
async def test_the_history_is_bounded_in_count_and_bytes(tmp_path: Path, count: int, size: int,
                                                         kept: int) -> None:
    """The file holds at most ``capacity`` finished transitions and at most
    MAX_HISTORY_BYTES, dropping the oldest; a new history reads back exactly those."""
    path = tmp_path / "transitions.json"
    history = TransitionHistory(path, capacity=4)
    for n in range(count):
        history.finished(_finished(n, "x" * size))
        await asyncio.sleep(0)
    await history.close()
    assert len(path.read_bytes()) <= MAX_HISTORY_BYTES + 200  # the header line
    wanted = [f"t{n}" for n in reversed(range(count - kept, count))]
    reread = TransitionHistory(path, capacity=4)
    assert [t.id for t in reread.newest_first()] == wanted
    assert reread.problem is None
    assert all(t.drain == DrainPolicy("wait", 2.5) and t.finished.is_set()
               for t in reread.newest_first())


async def test_a_running_transition_is_not_written(tmp_path: Path) -> None:
    """Only finished transitions reach the file: one still running at a crash is resolved
    (and then recorded) by the journal's recovery, never shown as running forever."""
    path = tmp_path / "transitions.json"
    history = TransitionHistory(path)
    running = Transition(id="run", gpu="GPU-x", gpu_index=0, requested="r", plan=EMPTY_PLAN,
                         drain=DrainPolicy())
    history.remember(running)
    history.finished(_finished(1))
    await history.close()
    assert [t["id"] for t in _on_disk(path)] == ["t1"]
    assert [t.id for t in history.newest_first()] == ["t1", "run"]


def _bad_file(path: Path) -> None:
    path.write_text("not an envelope")


def _wrong_kind(path: Path) -> None:
    path.write_bytes(b'{"format": "gpu-agent-events", "version": 1, "sha256": "x"}\n{}')


def _a_directory(path: Path) -> None:
    path.mkdir()


def _bad_entry(path: Path) -> None:
    write_durable(path, HISTORY_KIND, dump_payload({"transitions": [{"id": "t1"}]}))


UNREADABLE = {"not an envelope": _bad_file, "another file's kind": _wrong_kind,
              "a directory where the file belongs": _a_directory,
              "an entry that is not a transition": _bad_entry}


@pytest.mark.parametrize("damage", UNREADABLE.values(), ids=UNREADABLE.keys())
async def test_an_unreadable_history_is_kept_aside_and_started_empty(tmp_path: Path,
                                                                     damage: Any) -> None:
    """The agent starts with an empty transition history, a warning event naming the file,
    the bad file kept aside (never deleted), and the next transition written afresh."""
    path = tmp_path / "state" / "mig" / "transitions.json"
    path.parent.mkdir(parents=True)
    damage(path)
    node = await open_services(tmp_path)
    try:
        assert node.mig.transitions() == []
        warned = [e for e in node.events.since(0) if e.kind == "mig.history_unreadable"]
        assert len(warned) == 1 and warned[0].severity == "warning"
        assert str(path) in warned[0].message
        assert list(path.parent.glob("transitions.json.corrupt-*"))
        t = await _change(node, 0, ["7g.80gb"])
    finally:
        await node.close()
    assert [d["id"] for d in _on_disk(path)] == [t.id]


def _wait_transition(agent: AgentProcess, location: str) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        body: dict[str, Any] = agent.request("GET", location).body
        return body if body["terminal"] else None
    return wait_for(ended, f"transition {location} to finish", 30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_real_agent_shows_its_transitions_after_a_restart(tmp_path: Path, sig: int) -> None:
    """A real agent process, stopped or killed once the history file holds its transitions,
    answers ``GET /v1/transitions`` and ``GET /v1/transitions/{id}`` after it restarts as it
    did before; the events' epoch changes, the transitions stay."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        ids = []
        for gpu, profiles in (("1", ["3g.40gb"]), ("2", ["1g.10gb", "1g.10gb"])):
            reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": profiles})
            assert reply.status == 202, reply.body
            ids.append(_wait_transition(agent, reply.headers["location"])["id"])
        before = agent.request("GET", "/v1/transitions").body["transitions"]
        epoch = agent.request("GET", "/v1/events").body["epoch"]
        path = state / "mig" / "transitions.json"
        wait_for(lambda: path.exists() and {t["id"] for t in _on_disk(path)} == set(ids),
                 "the history file to hold both transitions")
        agent.stop(sig)
        agent = start_agent(state)
        after = agent.request("GET", "/v1/transitions").body["transitions"]
        assert after == before
        assert [t["state"] for t in after] == ["succeeded", "succeeded"]
        one = agent.request("GET", f"/v1/transitions/{ids[0]}")
        assert one.status == 200 and one.body == before[1]
        assert agent.request("GET", "/v1/events").body["epoch"] != epoch
        assert json.loads(path.read_bytes().partition(b"\n")[0])["format"] == \
            "gpu-agent-mig-transitions"
    finally:
        agent.stop(signal.SIGKILL)
