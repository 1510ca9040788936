"""Durable files: atomic replacement, exclusive locks, and corrupt files kept aside."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.durable import ExclusiveLock, keep_aside, write_atomic
from agent.errors import StateLocked


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
