"""The checkpoint's tombstones: kept oldest first, so pruning on every prepare costs only what
it drops, however many a busy node holds; ordering stamps kept with claims and tombstones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.claims.checkpoint import KIND, ClaimCheckpoint, ClaimRecord, decode, encode
from agent.durable import encode_envelope


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


def _record(uid: str, stamp: int | None) -> ClaimRecord:
    return ClaimRecord(uid=uid, state="prepare_completed", devices=[], request_digest="d",
                       created_at=1.0, updated_at=1.0, issued_at_ns=stamp)


async def test_stamps_are_kept_within_a_boot_and_dropped_across_one(tmp_path: Path) -> None:
    """A claim's stamp and its tombstones' stamps are durable within one boot; after a
    reboot none is left (CLOCK_BOOTTIME starts again), tombstones included."""
    path = tmp_path / "claims.checkpoint"
    first = ClaimCheckpoint(path, "boot-1")
    first.data.claims["c"] = _record("c", 42)
    first.tombstone("t", 7)
    first.tombstone("plain")
    await first.commit()
    same = ClaimCheckpoint(path, "boot-1")
    same.load()
    assert same.data.claims["c"].issued_at_ns == 42
    assert same.data.tombstone_stamps == {"t": 7}
    rebooted = ClaimCheckpoint(path, "boot-2")
    assert rebooted.load() == "boot-1"
    assert rebooted.data.claims["c"].issued_at_ns is None
    assert rebooted.data.tombstones == {} and rebooted.data.tombstone_stamps == {}


TOMBSTONE_STAMPS = [
    # (stamps of successive unprepares of one UID, the stamp its tombstone keeps)
    ([5], 5),
    ([5, 9], 9),
    ([9, 5], 9),  # a late repeat does not move it back
    ([5, None], None),  # an unstamped unprepare leaves an unstamped tombstone
    ([None, 5], 5),
]


@pytest.mark.parametrize(("stamps", "kept"), TOMBSTONE_STAMPS)
def test_a_tombstone_keeps_its_newest_stamp(tmp_path: Path, stamps: list[int | None],
                                            kept: int | None) -> None:
    """Repeated unprepares of one UID leave the newest stamp, or none after an unstamped one."""
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    for stamp in stamps:
        checkpoint.tombstone("u", stamp)
    assert checkpoint.data.tombstone_stamps.get("u") == kept


def test_pruned_and_capped_tombstones_take_their_stamps_along(tmp_path: Path) -> None:
    """Stamps never outlive their tombstone."""
    checkpoint = ClaimCheckpoint(tmp_path / "c", "boot")
    for i in range(6):
        checkpoint.tombstone(f"u{i}", i)
    checkpoint.cap_tombstones(2)
    assert checkpoint.data.tombstone_stamps == {"u4": 4, "u5": 5}
    checkpoint.prune_tombstones(-1.0)
    assert checkpoint.data.tombstone_stamps == {}


def test_a_checkpoint_without_stamps_reads_as_unstamped() -> None:
    """A checkpoint written before stamps existed reads with no stamp anywhere."""
    payload = {"schema_version": 1, "boot_id": "b", "tombstones": {"t": 1.0}, "claims": {
        "c": {"uid": "c", "state": "prepare_completed", "request_digest": "d",
              "created_at": 1.0, "updated_at": 1.0, "devices": [
                  {"request": "gpu", "kind": "gpu", "gpu": "GPU-1", "device_name": "gpu-0",
                   "cdi_device": "k8s.gpu.nodeagent.dev/claim=c-gpu-0"}]}}}
    data = decode(encode_envelope(KIND, json.dumps(payload).encode()))
    assert data.claims["c"].issued_at_ns is None
    assert data.claims["c"].devices[0].admin_access is False
    assert data.tombstone_stamps == {}


async def test_each_commit_writes_the_checkpoint_as_it_stands_in_memory(tmp_path: Path) -> None:
    """Commit after commit, whatever changed in between (tombstones added, moved, pruned,
    dropped and put back, a claim added), the file holds exactly ``encode`` of the data in
    memory: the tombstones' encoding kept between commits is never stale."""
    path = tmp_path / "claims.checkpoint"
    checkpoint = ClaimCheckpoint(path, "boot")
    data = checkpoint.data
    steps = [
        lambda: [checkpoint.tombstone(f"u{i}", issued_at_ns=i) for i in range(5)],
        lambda: None,  # nothing changed
        lambda: checkpoint.tombstone("u1", issued_at_ns=9),  # moved to the end, new stamp
        lambda: data.claims.update({"c": ClaimRecord(
            uid="c", state="prepare_completed", devices=[], request_digest="d",
            created_at=1.0, updated_at=2.0)}),
        lambda: checkpoint.drop_tombstone("u2"),
        lambda: (data.tombstones.update({"u2": 7.5}), data.tombstone_stamps.update({"u2": 3})),
        lambda: data.tombstones.update({"u3": data.tombstones.pop("u3")}),  # order only
        lambda: checkpoint.cap_tombstones(2),
    ]
    for step in steps:
        step()
        await checkpoint.commit()
        assert path.read_bytes() == encode(data)
        assert decode(path.read_bytes()) == data
