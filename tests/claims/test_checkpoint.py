"""The checkpoint's tombstones: kept oldest first, so pruning on every prepare costs only what
it drops, however many a busy node holds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.claims.checkpoint import ClaimCheckpoint


def test_a_repeated_tombstone_moves_to_the_end(tmp_path: Path) -> None:
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    for uid in ("a", "b", "c"):
        checkpoint.tombstone(uid)
    checkpoint.tombstone("a")
    assert list(checkpoint.data.tombstones) == ["b", "c", "a"]


def test_pruning_drops_the_expired_and_keeps_the_rest(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    now = time.time()
    for age, uid in ((300, "old-1"), (200, "old-2"), (50, "new-1"), (10, "new-2")):
        monkeypatch.setattr(time, "time", lambda at=now - age: at)
        checkpoint.tombstone(uid)
    monkeypatch.setattr(time, "time", lambda: now)
    checkpoint.prune_tombstones(100.0)
    assert list(checkpoint.data.tombstones) == ["new-1", "new-2"]
    checkpoint.prune_tombstones(5.0)
    assert checkpoint.data.tombstones == {}


def test_pruning_stops_at_the_first_unexpired(tmp_path: Path) -> None:
    """Written out of order (a clock stepped back), a later expired one waits for its turn:
    it only keeps refusing a UID Kubernetes never reuses a little longer."""
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    now = time.time()
    checkpoint.data.tombstones.update({"fresh": now, "stale": now - 1000})
    checkpoint.prune_tombstones(100.0)
    assert list(checkpoint.data.tombstones) == ["fresh", "stale"]
