"""The event history: bounded in count and bytes, kept across restarts in the durable
envelope, one epoch per start, and cursors that say when they no longer fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.durable import read_durable
from agent.events import HISTORY_KIND, MAX_HISTORY_BYTES, EventLog


def _log(path: Path, capacity: int = 1000) -> EventLog:
    return EventLog(capacity, history=path)


def test_history_is_bounded_and_sequence_numbers_go_on(tmp_path: Path) -> None:
    """A restarted log holds at most ``capacity`` of the newest events, and numbers on from
    the last one it found."""
    path = tmp_path / "events.json"
    first = _log(path, capacity=100)
    for k in range(250):
        first.append("test.event", f"event {k}")
    first.close()
    second = _log(path, capacity=100)
    kept = second.since(0)
    assert [e.seq for e in kept] == list(range(151, 251))
    assert {e.epoch for e in kept} == {first.epoch} and second.epoch != first.epoch
    assert second.append("test.event", "after").seq == 251


def test_history_file_stays_under_its_byte_bound(tmp_path: Path) -> None:
    """Large events drop the oldest ones from the file, never grow it past the bound."""
    path = tmp_path / "events.json"
    log = _log(path)
    for k in range(400):
        log.append("test.big", f"event {k}", details={"blob": "x" * 8000})
    log.close()
    assert path.stat().st_size <= MAX_HISTORY_BYTES + 200  # plus the envelope's header line
    kept = read_durable(path, HISTORY_KIND, lambda e: e.payload["events"])
    assert kept and kept[-1]["message"] == "event 399"
    assert 0 < len(kept) < 400


@pytest.mark.parametrize(("cursor", "reset", "seqs"), [
    ((0, None), False, [1, 2, 3, 4]),
    ((2, None), False, [3, 4]),
    ((4, None), False, []),
    ((9, None), True, [1, 2, 3, 4]),          # beyond the newest: a reset, everything kept
    ((1, "old"), False, [2, 3, 4]),           # an earlier epoch reads on from its place
    ((1, "0" * 16), True, [1, 2, 3, 4]),      # an epoch this history does not hold
])
def test_cursors(tmp_path: Path, cursor: tuple[int, str | None], reset: bool,
                 seqs: list[int]) -> None:
    """What a cursor ``(since, epoch)`` reads, across one restart (seq 1-2 before it)."""
    path = tmp_path / "events.json"
    before = _log(path)
    before.append("a", "one")
    before.append("b", "two")
    before.close()
    log = _log(path)
    log.append("c", "three")
    log.append("d", "four")
    since, epoch = cursor
    page = log.after(since, before.epoch if epoch == "old" else epoch)
    assert page.reset is reset
    assert [e.seq for e in page.events] == seqs


def test_an_unreadable_history_is_kept_aside_and_started_afresh(tmp_path: Path) -> None:
    """A damaged history never stops the agent: it is moved aside and numbering restarts."""
    path = tmp_path / "events.json"
    path.write_text("not an envelope")
    log = _log(path)
    assert log.since(0) == []
    assert list(tmp_path.glob("events.json.corrupt-*"))
    assert log.append("x", "first").seq == 1
