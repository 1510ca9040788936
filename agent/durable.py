"""Durable files: one envelope, atomic replace with fsync, exclusive locks, and unreadable
files kept aside.

Every file the agent owns (claims checkpoint, MIG journal entries, desired geometry,
quarantine, pool generation, simulator state) is one envelope::

    {"format": "gpu-agent-claims-checkpoint", "version": 1, "sha256": "<hex>"}\\n
    <payload: JSON>

The first line is a JSON header: ``format`` names the file kind (a file copied to the wrong
place is refused as such), ``version`` the payload's schema version, ``sha256`` the digest of
the payload bytes *exactly as written* (never of a re-marshalling, so a newer agent adding
fields never makes an older one see a mismatch: dra-driver #1080). It is today's claims
checkpoint format generalised: a checkpoint written in the envelope is still read by an agent
that predates it. :func:`read_durable` is the one reader: it verifies the envelope, ignores
header fields it does not know, reads a higher ``version`` (logging it; the payload parsers
ignore unknown fields), reads every format an earlier agent wrote (through each kind's
``legacy`` parser), and keeps anything it cannot trust aside with :func:`keep_aside` —
including a path of the wrong type (a directory or FIFO where a file belongs) — raising
:class:`Unreadable`, never a traceback of the caller's.

Written through :func:`write_atomic`, so a reader sees either the old bytes or the new ones,
and the new ones survive a power cut once the call returns. Every write here blocks on fsync:
callers on the event loop run it in a thread (``DurableMap`` does so itself).

Downgrade to an agent from before the envelope (2026-12), file by file:

- ``claims.checkpoint``: read as before (same header line; the new ``version`` is ignored).
- ``mig/journal/<gpu>.json``: not JSON to the old reader; the entry is kept aside as corrupt
  and that GPU is quarantined (fail closed, the agent starts).
- ``mig/desired.json``: kept aside as unreadable, reported as a ``mig.state_unreadable``
  event; geometries are not re-applied at start until set again (the agent starts).
- ``mig/quarantine.json``: kept aside as unreadable and reported, but the old agent starts
  with no GPU quarantined (its known fail-open defect, issue 12): re-check quarantined GPUs
  by hand after a downgrade.
- ``dra/pool.json``: kept aside; the old agent restarts the generation from the clock, above
  any earlier value (slices stay current).
- ``sim/hardware.json`` (simulator only): the old simulator refuses to start once, keeping
  the file aside; the next start makes a fresh simulated node (new GPU UUIDs).

None of these crash-loops: each is reported once, moved aside, and the next start is clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.errors import StateLocked, StateUnreadable, StorageUnavailable

log = logging.getLogger("agent.durable")
T = TypeVar("T")


def document_digest(doc: dict[str, Any]) -> str:
    """SHA-256 over a JSON document without its own ``sha256`` field (canonical JSON): the
    checksum of the formats from before the envelope, kept to read them."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- the envelope -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FileKind:
    """One kind of durable file: the ``format`` name in its header, the payload ``version``
    this agent writes, and how to read the whole-file JSON an agent from before the envelope
    wrote (``legacy``: the parsed document in, the payload out, :class:`ValueError` when it
    does not verify; ``None`` when there was no such format)."""

    format: str
    version: int
    legacy: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Envelope:
    """A verified file: its header (unknown fields kept), version and parsed payload."""

    header: dict[str, Any]
    version: int
    payload: Any
    payload_bytes: bytes | None = None
    """The payload as written (``None`` for a legacy format)."""
    legacy: bool = False
    """Read from a format that predates the envelope (the next write upgrades it)."""


class Unreadable(Exception):
    """A durable file that cannot be trusted: damaged, of another kind, or a path of the wrong
    type. It was moved to ``kept_at`` (``None`` when it could not be moved: ``reason`` says
    why); ``suffix`` is the keep-aside tag (``checksum`` or ``unreadable``)."""

    def __init__(self, path: Path, kept_at: Path | None, reason: str, suffix: str) -> None:
        where = f"kept aside as {kept_at}" if kept_at is not None else "left in place"
        super().__init__(f"{path} is unreadable ({reason}); {where}")
        self.path = path
        self.kept_at = kept_at
        self.reason = reason
        self.suffix = suffix


def encode_envelope(kind: FileKind, payload: bytes) -> bytes:
    """The file's bytes: the header line, then ``payload`` (serialised JSON) unchanged."""
    return b"".join((_header_prefix(kind), hashlib.sha256(payload).hexdigest().encode(),
                     b'"}\n', payload))


@functools.lru_cache(maxsize=64)
def _header_prefix(kind: FileKind) -> bytes:
    """The header line up to the digest: ``json.dumps`` of the header dict, as it was, is
    ``{"format": ..., "version": N, "sha256": "<hex>"}`` (the checkpoint's is written twice
    per claim)."""
    return json.dumps({"format": kind.format, "version": kind.version, "sha256": ""}
                      ).encode()[:-2]


def dump_payload(value: Any, *, indent: int | None = 1) -> bytes:
    """A JSON payload; indented by default (operators read these files), compact for hot
    files (``indent=None``)."""
    return json.dumps(value, indent=indent, sort_keys=True).encode()


def decode_envelope(raw: bytes, kind: FileKind) -> Envelope:
    """Parse and verify one file of ``kind`` (envelope or a legacy format);
    :class:`ValueError` says what is wrong."""
    header_line, sep, payload = raw.partition(b"\n")
    header: Any = None
    with contextlib.suppress(ValueError):
        header = json.loads(header_line)
    if isinstance(header, dict) and "format" in header:
        if header["format"] != kind.format:
            raise ValueError(f"a {header['format']!r} file, not {kind.format!r}")
        if not sep:
            raise ValueError("no payload after the header line")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError("checksum mismatch")
        version = header.get("version", 1)  # the checkpoint's header had none before
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"header version {version!r} is not an integer")
        try:
            parsed = json.loads(payload)
        except ValueError as err:
            raise ValueError(f"payload is not JSON: {err}") from err
        if version > kind.version:
            log.warning("file written by a newer agent; fields this one does not know are "
                        "ignored", extra={"format": kind.format, "version": version,
                                          "reads": kind.version})
        return Envelope(header=header, version=version, payload=parsed, payload_bytes=payload)
    if kind.legacy is None:
        raise ValueError(f"not a {kind.format!r} file (no header line)")
    try:
        document = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"neither a {kind.format!r} envelope nor an older format: {err}") \
            from err
    legacy_payload = kind.legacy(document)
    version = document.get("schema_version", 1) if isinstance(document, dict) else 1
    return Envelope(header={}, version=version if isinstance(version, int) else 1,
                    payload=legacy_payload, legacy=True)


def read_durable(path: Path, kind: FileKind, parse: Callable[[Envelope], T]) -> T | None:
    """The one reader: ``parse(envelope)`` of the file at ``path``, or ``None`` when there is
    none. Anything that cannot be trusted — damage, another kind, a payload ``parse`` rejects
    (:class:`ValueError`, :class:`KeyError`, :class:`TypeError`), JSON nested too deep to
    parse, a directory or other non-file at ``path`` — is kept aside and raised as
    :class:`Unreadable`."""
    try:
        raw = _read_regular_file(path)
    except FileNotFoundError:
        return None
    except _NotAFile as err:
        raise _unreadable(path, str(err), "unreadable") from err
    except OSError as err:
        # EACCES, EIO, a parent that is not a directory: the bytes may be fine, so they stay
        # where they are; the caller treats them as unreadable all the same (fail closed).
        raise Unreadable(path, None, f"cannot be read: {err.strerror or err}",
                         "unreadable") from err
    try:
        return parse(decode_envelope(raw, kind))
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        suffix = "checksum" if "checksum" in str(err) else "unreadable"
        raise _unreadable(path, f"{type(err).__name__}: {str(err)[:300]}", suffix) from err


def write_durable(path: Path, kind: FileKind, payload: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with an envelope of ``kind`` around ``payload``, durably (blocks on
    fsync: run it in a thread from the event loop). Raises :class:`StorageUnavailable`."""
    write_atomic(path, encode_envelope(kind, payload), mode=mode)


class _NotAFile(OSError):
    """Something other than a regular file is where a file belongs."""


def _read_regular_file(path: Path) -> bytes:
    # O_NONBLOCK: a FIFO put where a file belongs must not hang the start-up.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise _NotAFile(f"the path is {kind}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _unreadable(path: Path, reason: str, suffix: str) -> Unreadable:
    try:
        kept: Path | None = keep_aside(path, suffix)
    except OSError as err:
        kept = None
        reason = f"{reason}; could not be moved aside: {err.strerror or err}"
    log.error("durable file unreadable", extra={"path": str(path), "error": reason,
                                                "kept_at": str(kept)})
    return Unreadable(path, kept, reason, suffix)


# -- writing ------------------------------------------------------------------------------------


def fsync_dir(directory: Path | str) -> None:
    """Flush a directory entry (a rename or a new file) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes, *, mode: int = 0o644,
                 durable: bool = True) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir.
    ``durable=False`` skips both fsyncs: readers still see the old or the new file, never a
    part, but a power loss may lose the change (for files rebuilt at every start).

    A failure (disk full, read-only directory, I/O error) leaves ``path`` as it was, removes
    the temp file and raises :class:`StorageUnavailable` (an ``OSError`` with the same errno).
    """
    try:
        _write_atomic(os.fspath(path), data, mode, durable)
    except StorageUnavailable:
        raise
    except OSError as err:
        raise StorageUnavailable(str(path), err) from err


def write_if_changed(path: Path, data: bytes, *, mode: int = 0o644) -> bool:
    """:func:`write_atomic` unless ``path`` already holds exactly ``data`` (then no space is
    needed: a start-up on a full disk rewrites nothing that is already right). True if it
    wrote."""
    with contextlib.suppress(OSError):
        if path.is_file() and path.read_bytes() == data:
            return False
    write_atomic(path, data, mode=mode)
    return True


# Temp names: the pid and a per-process counter. Unique per call (O_EXCL): two threads writing
# the same file must never share, and so rename away, each other's temp file; one a crashed
# process with the same pid left behind is skipped. (A random suffix per write cost a
# getrandom call; these writes are on every claim's path.)
_TEMP_SERIAL = itertools.count()
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_PID = [os.getpid()]  # a getpid call per write, kept; a forked child takes its own
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def _open_temp(directory: str, name: str, mode: int) -> tuple[str, int]:
    """A new temp file beside ``name`` in ``directory`` (made when missing): its path and
    descriptor."""
    made_directory = False
    while True:
        tmp = f"{directory}/.{name}.tmp.{_PID[0]}.{next(_TEMP_SERIAL)}"
        try:
            return tmp, os.open(tmp, _CREATE, mode)
        except FileExistsError:
            continue
        except FileNotFoundError:
            # The directory itself is missing (first write): made once, then retried. Asking
            # for it on every write cost a mkdir call per write.
            if made_directory:
                raise
            os.makedirs(directory, exist_ok=True)
            made_directory = True


def _write_atomic(path: str, data: bytes, mode: int, durable: bool) -> None:
    directory, _, name = path.rpartition("/")
    directory = directory or ("/" if path.startswith("/") else ".")
    tmp, fd = _open_temp(directory, name, mode)
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
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


def keep_aside(path: Path, reason: str) -> Path:
    """Move an untrustworthy file (or whatever is at ``path``: a directory too) aside as
    ``<name>.corrupt-<ts>-<reason>``; never delete it. Raises ``OSError`` if it cannot be
    moved (a mount point, a read-only directory)."""
    stamp = time.strftime('%Y%m%dT%H%M%S')
    target = path.with_name(f"{path.name}.corrupt-{stamp}-{reason}")
    serial = 1
    while os.path.lexists(target):  # never replace an earlier kept file (or a directory)
        serial += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}.{serial}-{reason}")
    os.replace(path, target)
    # The rename is what matters: if flushing it fails (a full or failing disk), the file may
    # come back after a power cut, to be found and kept aside again.
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)
    return target


class ExclusiveLock:
    """An advisory ``flock`` on a file, held for the life of the object; the holder's pid is
    written into the file so a refused second process can say who holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; raise :class:`StateLocked` naming the holder. On a
        full disk the lock is still taken (an existing file opens without space); only the
        pid note may be missing."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StateUnreadable(f"cannot open the lock file {self.path}: "
                                  f"{err.strerror or err}; it must be a regular file",
                                  path=str(self.path), reason=err.strerror) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateLocked(path=str(self.path), holder_pid=holder or "unknown") from err
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as err:
            log.warning("lock taken, but its holder pid could not be written",
                        extra={"path": str(self.path), "error": str(err)})
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


MAP_VERSION = 1


def _legacy_map(document: Any) -> Any:
    """A map from before the envelope: ``{"schema_version", "items", "sha256"?}``."""
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if "sha256" in document and document["sha256"] != document_digest(document):
        raise ValueError("checksum mismatch")
    return {"items": document.get("items")}


def _map_items(envelope: Envelope) -> dict[str, Any]:
    items = envelope.payload.get("items") if isinstance(envelope.payload, dict) else None
    if not isinstance(items, dict):
        raise ValueError("not a {'items': {...}} object")
    return items


class DurableMap:
    """A small JSON object on disk (key → JSON value), rewritten atomically on every change.

    For records the agent keeps across restarts (desired MIG geometries, quarantined GPUs,
    the pool generation), each in its own ``format``. A file that cannot be trusted (see
    :func:`read_durable`: damaged, another kind, a directory where the file belongs) is kept
    aside and the map starts empty; ``problem`` says so, for the caller to report loudly and
    fail closed. Files from before the envelope (with or without their ``sha256``) load, and
    unknown fields from a newer agent are ignored.

    Changes are awaitable and fsync'd in a thread, one at a time: memory changes only once
    the file does, and a change whose caller is cancelled still completes (or fails) whole.
    """

    def __init__(self, path: Path, format: str = "gpu-agent-map") -> None:
        self.path = path
        self.kind = FileKind(format, MAP_VERSION, legacy=_legacy_map)
        self.problem: str | None = None
        self._data: dict[str, Any] = {}
        self._lock = asyncio.Lock()
        try:
            self._data = read_durable(path, self.kind, _map_items) or {}
        except Unreadable as err:
            self.problem = str(err)

    def get(self, key: str) -> Any:
        return self._data.get(key)

    def items(self) -> list[tuple[str, Any]]:
        return sorted(self._data.items())

    async def set(self, key: str, value: Any) -> None:
        """Change ``key``; memory changes only once the file does (no unacknowledged state).
        Raises :class:`StorageUnavailable` with nothing changed."""
        await self._change(lambda data: {**data, key: value})

    async def delete(self, key: str) -> None:
        """Remove ``key`` (durably; nothing to write if it is not there)."""
        await self._change(lambda data: {k: v for k, v in data.items() if k != key})

    async def _change(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        # Shielded: the write runs in a thread that cancellation cannot stop, so memory must
        # follow it whatever happens to the caller.
        task = asyncio.ensure_future(self._apply(change))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _apply(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        async with self._lock:  # one write at a time, each from the latest data
            data = change(self._data)
            if data == self._data:
                return
            payload = dump_payload({"items": data})
            await asyncio.to_thread(write_durable, self.path, self.kind, payload)
            self._data = data


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a shielded write's outcome seen (its caller, if still there, got it already)."""
    if not task.cancelled():
        task.exception()
