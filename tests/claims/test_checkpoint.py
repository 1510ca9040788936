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


async def test_a_commit_with_nothing_changed_writes_nothing(tmp_path: Path) -> None:
    """Reloading and committing an unchanged checkpoint needs no write (so a restart on a
    full disk can finish reconciliation); any change is written."""
    path = tmp_path / "claims.checkpoint"
    first = ClaimCheckpoint(path, "boot")
    first.tombstone("a")
    await first.commit()
    inode = path.stat().st_ino
    again = ClaimCheckpoint(path, "boot")
    assert again.load() is None
    await again.commit()
    assert again.fsyncs == 0 and path.stat().st_ino == inode
    again.tombstone("b")
    await again.commit()
    assert again.fsyncs == 1 and path.stat().st_ino != inode
    reread = ClaimCheckpoint(path, "boot")
    reread.load()
    assert list(reread.data.tombstones) == ["a", "b"]


async def test_a_new_boot_is_always_written(tmp_path: Path) -> None:
    """After a reboot the loaded checkpoint is rewritten with the new boot id."""
    path = tmp_path / "claims.checkpoint"
    await ClaimCheckpoint(path, "boot-1").commit()
    after = ClaimCheckpoint(path, "boot-2")
    assert after.load() == "boot-1"
    await after.commit()
    assert after.fsyncs == 1


def test_tombstones_are_capped_oldest_first(tmp_path: Path) -> None:
    """Unprepares cannot grow the checkpoint without bound: past the cap, the oldest
    tombstones go first."""
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    for i in range(10):
        checkpoint.tombstone(f"u{i}")
    checkpoint.cap_tombstones(4)
    assert list(checkpoint.data.tombstones) == ["u6", "u7", "u8", "u9"]
