"""Durable files: atomic replace with fsync, exclusive locks, and corrupt files kept aside.

Every file the agent owns (simulator state, checkpoint, journal, CDI specs) is written
through :func:`write_atomic`, so a reader sees either the old bytes or the new ones, and the
new ones survive a power cut once the call returns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.errors import StateLocked, StorageUnavailable


def document_digest(doc: dict[str, Any]) -> str:
    """SHA-256 over a JSON document without its own ``sha256`` field (canonical JSON)."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename or a new file) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir.
    ``durable=False`` skips both fsyncs: readers still see the old or the new file, never a
    part, but a power loss may lose the change (for files rebuilt at every start).

    A failure (disk full, read-only directory, I/O error) leaves ``path`` as it was, removes
    the temp file and raises :class:`StorageUnavailable` (an ``OSError`` with the same errno).
    """
    try:
        _write_atomic(path, data, mode, durable)
    except StorageUnavailable:
        raise
    except OSError as err:
        raise StorageUnavailable(str(path), err) from err


def _write_atomic(path: Path, data: bytes, mode: int, durable: bool) -> None:
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    # Unique per call (O_EXCL): two threads writing the same file must never share, and so
    # rename away, each other's temp file.
    tmp = directory / f".{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(directory)


def keep_aside(path: Path, reason: str) -> Path:
    """Move an untrustworthy file aside as ``<name>.corrupt-<ts>-<reason>``; never delete it."""
    target = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{reason}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


class ExclusiveLock:
    """An advisory ``flock`` on a file, held for the life of the object; the holder's pid is
    written into the file so a refused second process can say who holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; raise :class:`StateLocked` naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateLocked(path=str(self.path), holder_pid=holder or "unknown") from err
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for a ``with`` block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


class DurableMap:
    """A small JSON object on disk (key → JSON value), rewritten atomically on every change.

    For records the agent keeps across restarts (desired MIG geometries, quarantined GPUs).
    A file that does not parse, or whose ``sha256`` (over the rest of the document, canonical
    JSON) does not match, is kept aside and the map starts empty; ``problem`` says so, for the
    caller to report loudly. Files from before the checksum (no ``sha256``) still load, and
    unknown top-level fields from a newer agent are ignored.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problem: str | None = None
        self._data: dict[str, Any] = {}
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        try:
            loaded = json.loads(raw)
            if not isinstance(loaded, dict) or not isinstance(loaded.get("items"), dict):
                raise ValueError("not a {'items': {...}} object")
            if "sha256" in loaded and loaded["sha256"] != document_digest(loaded):
                raise ValueError("checksum mismatch")
            self._data = loaded["items"]
        except (ValueError, UnicodeDecodeError) as err:
            kept = keep_aside(path, "unreadable")
            self.problem = f"{path} was unreadable ({err}); kept aside as {kept}"

    def get(self, key: str) -> Any:
        return self._data.get(key)

    def items(self) -> list[tuple[str, Any]]:
        return sorted(self._data.items())

    def set(self, key: str, value: Any) -> None:
        """Change ``key``; memory changes only once the file does (no unacknowledged state)."""
        self._flush({**self._data, key: value})

    def delete(self, key: str) -> None:
        if key in self._data:
            self._flush({k: v for k, v in self._data.items() if k != key})

    def _flush(self, data: dict[str, Any]) -> None:
        doc: dict[str, Any] = {"schema_version": 1, "items": data}
        doc["sha256"] = document_digest(doc)
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())
        self._data = data
