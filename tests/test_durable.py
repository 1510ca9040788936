"""Durable files: atomic replacement, exclusive locks, and corrupt files kept aside."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.durable import (
    DurableMap,
    ExclusiveLock,
    FileKind,
    Unreadable,
    decode_envelope,
    encode_envelope,
    keep_aside,
    read_durable,
    write_atomic,
    write_durable,
)
from agent.errors import AgentError, StateLocked
from tests.waiting import until


def test_write_atomic_replaces_content_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"
    write_atomic(target, b"one")
    write_atomic(target, b"two", mode=0o600)
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_exclusive_lock_refuses_a_second_process_and_names_the_holder(tmp_path: Path) -> None:
    lock = ExclusiveLock(tmp_path / "agent.lock")
    with lock.held():
        code = (
            "import sys; from pathlib import Path; from agent.durable import ExclusiveLock\n"
            "from agent.errors import StateLocked\n"
            f"try: ExclusiveLock(Path({str(tmp_path / 'agent.lock')!r})).acquire()\n"
            "except StateLocked as e: print(e.detail); sys.exit(3)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 3
        assert f"pid {os.getpid()}" in result.stdout
    # Released: a new holder gets it.
    ExclusiveLock(tmp_path / "agent.lock").acquire()


def test_same_process_second_lock_object_is_refused(tmp_path: Path) -> None:
    first = ExclusiveLock(tmp_path / "agent.lock")
    first.acquire()
    with pytest.raises(StateLocked):
        ExclusiveLock(tmp_path / "agent.lock").acquire()
    first.release()


def test_keep_aside_moves_and_never_deletes(tmp_path: Path) -> None:
    bad = tmp_path / "checkpoint.json"
    bad.write_bytes(b"\x00garbage")
    moved = keep_aside(bad, "checksum")
    assert not bad.exists()
    assert moved.read_bytes() == b"\x00garbage"
    assert moved.name.startswith("checkpoint.json.corrupt-") and moved.name.endswith("-checksum")


def test_concurrent_writers_of_one_file_never_collide(tmp_path: Path) -> None:
    """Threads replacing the same file each use their own temp file (a shared one was renamed
    away under the other writer: FileNotFoundError at start-up)."""
    target = tmp_path / "spec.json"
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(50):
                write_atomic(target, f"{n}-{i}".encode())
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]


# -- the envelope ---------------------------------------------------------------------------

KIND = FileKind("gpu-agent-test", 2, legacy=lambda doc: {"items": doc["items"]})


def _header(raw: bytes) -> dict[str, object]:
    return dict(json.loads(raw.partition(b"\n")[0]))


def test_envelope_header_names_format_version_and_digest_of_the_payload_as_written() -> None:
    payload = b'{"b": 1,   "a": 2}'  # not canonical: the digest is over these very bytes
    raw = encode_envelope(KIND, payload)
    assert raw.partition(b"\n")[2] == payload
    assert _header(raw) == {"format": "gpu-agent-test", "version": 2,
                            "sha256": hashlib.sha256(payload).hexdigest()}
    assert decode_envelope(raw, KIND).payload == {"a": 2, "b": 1}


@pytest.mark.parametrize(("name", "raw", "version"), [
    ("unknown header fields", b'{"format": "gpu-agent-test", "version": 2, "zstd": false, '
                              b'"sha256": "%s"}\n{"x": 1, "new": [1]}', 2),
    ("a newer version", b'{"format": "gpu-agent-test", "version": 9, '
                        b'"sha256": "%s"}\n{"x": 1, "new": [1]}', 9),
    ("no version (the checkpoint before the envelope)",
     b'{"format": "gpu-agent-test", "sha256": "%s"}\n{"x": 1, "new": [1]}', 1),
])
def test_envelope_reader_tolerates_what_it_does_not_know(name: str, raw: bytes,
                                                         version: int) -> None:
    """Unknown header fields, a higher version and unknown payload fields are read, never
    refused (a downgrade must not crash-loop)."""
    payload = raw.partition(b"\n")[2]
    raw = raw.replace(b"%s", hashlib.sha256(payload).hexdigest().encode())
    envelope = decode_envelope(raw, KIND)
    assert envelope.version == version and envelope.payload == {"x": 1, "new": [1]}


@pytest.mark.parametrize(("raw", "says"), [
    (encode_envelope(FileKind("gpu-agent-other", 1), b"{}"), "gpu-agent-other"),
    (encode_envelope(KIND, b'{"x": 1}')[:-2], "checksum"),
    (b'{"format": "gpu-agent-test", "sha256": "00"}', "no payload"),
    (b'{"format": "gpu-agent-test", "version": "2", "sha256": "%s"}\n{}', "version"),
    (b"", "older format"),
    (b"\x00" * 40, "older format"),
])
def test_envelope_reader_refuses_what_it_cannot_trust(raw: bytes, says: str) -> None:
    raw = raw.replace(b"%s", hashlib.sha256(b"{}").hexdigest().encode())
    with pytest.raises(ValueError, match=says):
        decode_envelope(raw, KIND)


def test_legacy_formats_are_read_through_their_kind() -> None:
    envelope = decode_envelope(b'{"schema_version": 1, "items": {"k": 1}}', KIND)
    assert envelope.legacy and envelope.payload == {"items": {"k": 1}}
    with pytest.raises(ValueError, match="no header line"):
        decode_envelope(b'{"items": {}}', FileKind("gpu-agent-new", 1))


def _make_fifo(path: Path) -> None:
    os.mkfifo(path)


def _make_dir(path: Path) -> None:
    (path / "inside").mkdir(parents=True)


@pytest.mark.parametrize("make", [_make_dir, _make_fifo], ids=["directory", "fifo"])
def test_a_path_of_the_wrong_type_is_unreadable_and_kept_aside(tmp_path: Path,
                                                               make: Callable[[Path], None]
                                                               ) -> None:
    """A directory or FIFO where a file belongs is the documented unreadable case: moved
    aside whole, raised as Unreadable naming where it went (and a FIFO never blocks)."""
    path = tmp_path / "state.json"
    make(path)
    with pytest.raises(Unreadable) as info:
        read_durable(path, KIND, lambda e: e.payload)
    kept = info.value.kept_at
    assert kept is not None and kept.name.startswith("state.json.corrupt-")
    assert not os.path.lexists(path) and os.path.lexists(kept)
    assert str(kept) in str(info.value)


def test_a_parent_that_is_not_a_directory_is_unreadable_left_in_place(tmp_path: Path) -> None:
    (tmp_path / "mig").write_bytes(b"not a directory")
    with pytest.raises(Unreadable) as info:
        read_durable(tmp_path / "mig" / "desired.json", KIND, lambda e: e.payload)
    assert info.value.kept_at is None
    assert (tmp_path / "mig").read_bytes() == b"not a directory"


def test_keep_aside_never_replaces_an_earlier_kept_file(tmp_path: Path) -> None:
    kept = []
    for content in (b"one", b"two"):
        (tmp_path / "f").write_bytes(content)
        kept.append(keep_aside(tmp_path / "f", "unreadable"))
    assert sorted(p.read_bytes() for p in kept) == [b"one", b"two"]


@pytest.mark.parametrize("damage", ["directory", "not-json", "other-format"])
def test_durable_map_reports_an_unreadable_file_and_starts_empty(tmp_path: Path,
                                                                damage: str) -> None:
    path = tmp_path / "quarantine.json"
    if damage == "directory":
        path.mkdir()
    elif damage == "not-json":
        path.write_bytes(b"{not json")
    else:
        write_durable(path, FileKind("gpu-agent-mig-desired", 1), b'{"items": {"g": 1}}')
    dmap = DurableMap(path, format="gpu-agent-mig-quarantine")
    assert dmap.problem is not None and "unreadable" in dmap.problem
    assert dmap.items() == []
    assert list(tmp_path.glob("quarantine.json.corrupt-*"))


async def test_durable_map_changes_are_fsyncd_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """set/delete fsync in a worker thread, never on the loop's thread."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        threads.append(threading.get_ident())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    dmap = DurableMap(tmp_path / "m.json")
    await dmap.set("a", 1)
    await dmap.delete("a")
    assert threads and loop_thread not in threads


async def test_durable_map_concurrent_and_cancelled_changes_all_land(tmp_path: Path) -> None:
    """Concurrent changes are written one at a time from the latest data, and a change whose
    caller is cancelled still completes: memory and file agree."""
    dmap = DurableMap(tmp_path / "m.json")
    changes = [asyncio.ensure_future(dmap.set(f"k{i}", i)) for i in range(8)]
    await asyncio.sleep(0)
    changes[3].cancel()
    await asyncio.gather(*changes, return_exceptions=True)
    await dmap.delete("never-there")
    # The cancelled caller's write finishes in its own time.
    await until(lambda: len(dmap.items()) == 8, "the cancelled caller's write to land")
    assert dmap.items() == [(f"k{i}", i) for i in range(8)]
    assert DurableMap(tmp_path / "m.json").items() == dmap.items()



def test_deeply_nested_json_is_unreadable_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    payload = b"[" * 100_000 + b"]" * 100_000
    write_durable(path, KIND, payload)
    with pytest.raises(Unreadable):
        read_durable(path, KIND, lambda e: e.payload)


def test_a_lock_path_that_is_a_directory_is_reported_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "agent.lock").mkdir()
    with pytest.raises(AgentError, match="lock file"):
        ExclusiveLock(tmp_path / "agent.lock").acquire()
