"""The claims checkpoint: who owns what, the one source of truth for prepared claims.

One file in the durable envelope (:mod:`agent.durable`: a header line with the format,
version and a SHA-256 over the payload bytes *as written*, then the payload), replaced
atomically (temp, fsync, rename, fsync dir). Readers ignore unknown fields. A file that fails
the check, or a path that is not a file, is moved aside and reported; it is never silently
replaced. Downgrade: an agent from before the envelope reads it unchanged (the envelope is
its own format generalised; it ignores the header's ``version``).

Writes are group-committed: concurrent callers of :meth:`ClaimCheckpoint.commit` share one
write that covers all of their changes, and each returns only once its change is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agent.durable import (
    Envelope,
    FileKind,
    Unreadable,
    decode_envelope,
    encode_envelope,
    read_durable,
    write_atomic,
)

log = logging.getLogger("agent.claims.checkpoint")
SCHEMA_VERSION = 1
KIND = FileKind("gpu-agent-claims-checkpoint", SCHEMA_VERSION)

ClaimState = Literal["prepare_started", "prepare_completed", "unprepare_started", "lost"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SliceRecord(_Record):
    """A MIG instance the agent creates for a claim (recorded before it is created)."""

    gpu: str
    profile: str
    profile_id: int
    start: int
    size: int
    gi_id: int | None = None
    ci_id: int | None = None


class DeviceSharingRecord(_Record):
    """What a device's sharing does (the plan of ``agent/claims/sharing.py``), and whether
    the agent applied the GPU-wide settings: ``None`` = intended, maybe applied (recorded
    before nvidia-smi ran, so a crash then still resets it), True = applied, False = not."""

    strategy: Literal["TimeSlicing", "MPS"]
    interval: str | None = None
    timeslice: int | None = None
    exclusive_process: bool = False
    thread_percentage: int | None = None
    pinned_mib: int | None = None
    timeslice_applied: bool | None = None
    compute_mode_applied: bool | None = None


class ShareRecord(_Record):
    """A counted share of a full GPU's memory (DRA consumable capacity)."""

    memory_mib: int
    share_id: str | None = None
    counted: bool = Field(default=True, description="Held as a counted share; False: the "
                          "share is all of the GPU's shareable memory, held as the whole GPU")


MpsState = Literal["starting", "running", "failed"]


class MpsDaemonRecord(_Record):
    """The claim's MPS control daemon: recorded (``starting``) before it is started."""

    root: str
    devices: list[str]
    thread_percentage: int | None = None
    pinned_limits_mib: dict[str, int] = {}
    state: MpsState = "starting"
    reason: str | None = None


class PreparedDevice(_Record):
    request: str
    kind: Literal["gpu", "mig"]
    gpu: str = Field(description="UUID of the GPU (the parent, for a MIG device)")
    uuid: str | None = Field(default=None, description="GPU or MIG UUID once known")
    gi_id: int | None = None
    ci_id: int | None = None
    device_name: str
    cdi_device: str
    slice: SliceRecord | None = None
    placement: tuple[int, int] | None = Field(
        default=None, description="Memory slices (start, size) of an existing MIG device")
    admin_access: bool = Field(
        default=False, description="Held for monitoring (DRA adminAccess): non-exclusive")
    #: Named apart from ``sharing``, a name fixtures use for a newer agent's unknown field.
    sharing_state: DeviceSharingRecord | None = None
    share: ShareRecord | None = None


class ImexChannelRecord(_Record):
    """The IMEX channel a claim holds for its compute domain (beside ``devices``, so an older
    agent reading the file ignores it instead of refusing a kind it does not know)."""

    request: str
    domain: str
    channel: int = 0
    device_name: str
    cdi_device: str


class ClaimRecord(_Record):
    uid: str
    state: ClaimState
    devices: list[PreparedDevice]
    request_digest: str
    metadata: dict[str, str] = {}
    cdi_spec: str | None = None
    created_at: float
    updated_at: float
    lost_reason: str | None = None
    issued_at_ns: int | None = Field(
        default=None, description="The newest ordering stamp (CLOCK_BOOTTIME ns of this boot) "
        "of a prepare this claim answered; None when no caller stamped one")
    mps: MpsDaemonRecord | None = None
    # One daemon per MPS config: the first in ``mps``, the others beside it, so an older agent
    # reading this file still finds (and stops) the first and ignores the new field.
    mps_more: list[MpsDaemonRecord] = Field(
        default=[], description="The claim's MPS daemons after the first (``mps``)")
    imex: ImexChannelRecord | None = None

    def daemons(self) -> list[MpsDaemonRecord]:
        """Every MPS daemon of the claim (one per MPS config), the first first."""
        return [self.mps, *self.mps_more] if self.mps is not None else list(self.mps_more)

    def set_daemons(self, daemons: list[MpsDaemonRecord]) -> None:
        self.mps, self.mps_more = (daemons[0], daemons[1:]) if daemons else (None, [])


class CheckpointData(_Record):
    schema_version: int = SCHEMA_VERSION
    boot_id: str
    claims: dict[str, ClaimRecord] = {}
    tombstones: dict[str, float] = Field(
        default={}, description="Claim UIDs unprepared in this boot, with the time")
    # Beside ``tombstones``, not inside it: an older agent reading this file ignores the new
    # field instead of failing on a changed value type (a downgrade keeps its claims).
    tombstone_stamps: dict[str, int] = Field(
        default={}, description="The ordering stamp (CLOCK_BOOTTIME ns) of the unprepare that "
        "left each stamped tombstone")


class CheckpointCorrupt(Exception):
    """The checkpoint failed its check, or its path is not a file; it was moved to
    ``kept_at`` (the path itself when it could not be moved: ``reason`` says so)."""

    def __init__(self, kept_at: Path, reason: str) -> None:
        super().__init__(f"claims checkpoint unreadable ({reason}); kept aside as {kept_at}"
                         if ".corrupt-" in kept_at.name else
                         f"claims checkpoint {kept_at} unreadable ({reason})")
        self.kept_at = kept_at
        self.reason = reason


def encode(data: CheckpointData) -> bytes:
    """The file's bytes (compact JSON: a third of the bytes to hash and fsync per commit)."""
    return encode_envelope(KIND, data.model_dump_json().encode())


_TOMBSTONES = TypeAdapter(dict[str, float])
_STAMPS = TypeAdapter(dict[str, int])
#: The last fields of :class:`CheckpointData`, in order, encoded apart by :class:`_Encoder`.
_TOMBSTONE_FIELDS = ("tombstones", "tombstone_stamps")
if tuple(CheckpointData.model_fields)[-2:] != _TOMBSTONE_FIELDS:  # pragma: no cover
    raise RuntimeError("CheckpointData must end with the tombstone fields (see _Encoder)")


class _Encoder:
    """:func:`encode`, reusing the tombstones' JSON while they are unchanged.

    Tombstones are most of a busy node's checkpoint (up to 4,096 claims unprepared in the
    window, about 330 KB) and a prepare leaves them as they are, yet every commit encoded them
    again: a millisecond of the loop per commit at the cap. The bytes are exactly
    :func:`encode`'s (the tombstone fields are the model's last; extra fields are ignored);
    a change is found by comparing with a copy of what was encoded, keys in order (a few
    percent of encoding them)."""

    def __init__(self) -> None:
        self._seen: tuple[dict[str, float], dict[str, int], bytes] | None = None

    def encode(self, data: CheckpointData) -> bytes:
        tombstones, stamps = data.tombstones, data.tombstone_stamps
        seen = self._seen
        if seen is None or not (_same(seen[0], tombstones) and _same(seen[1], stamps)):
            tail = b"".join((b',"tombstones":', _TOMBSTONES.dump_json(tombstones),
                             b',"tombstone_stamps":', _STAMPS.dump_json(stamps), b"}"))
            seen = self._seen = (dict(tombstones), dict(stamps), tail)
        head = data.model_dump_json(exclude=set(_TOMBSTONE_FIELDS)).encode()
        return encode_envelope(KIND, head[:-1] + seen[2])


def _same(seen: dict[str, Any], now: dict[str, Any]) -> bool:
    """Equal, keys in the same order."""
    return seen == now and list(seen) == list(now)


def _parse(envelope: Envelope) -> tuple[CheckpointData, bytes | None]:
    """The data, and the file's bytes when re-encoding it gives exactly those (then a commit
    with nothing changed needs no write: a start-up on a full disk)."""
    try:
        data = CheckpointData.model_validate(envelope.payload)
    except ValidationError as err:
        raise ValueError(f"payload does not parse: {err.errors()[0]['msg']}") from err
    if data.schema_version > SCHEMA_VERSION >= envelope.version:  # else the envelope said so
        log.warning("checkpoint written by a newer agent; unknown fields are ignored",
                    extra={"schema_version": data.schema_version})
    same = (envelope.version == SCHEMA_VERSION and envelope.payload_bytes is not None
            and data.model_dump_json().encode() == envelope.payload_bytes)
    return data, encode(data) if same else None


def decode(raw: bytes) -> CheckpointData:
    """Parse and verify; :class:`ValueError` says what is wrong."""
    return _parse(decode_envelope(raw, KIND))[0]


class ClaimCheckpoint:
    """The in-memory checkpoint and its durable copy."""

    def __init__(self, path: Path, boot_id: str,
                 on_write: Callable[[], None] | None = None) -> None:
        self.path = path
        self.data = CheckpointData(boot_id=boot_id)
        self.fsyncs = 0
        self._on_write = on_write
        self._version = 0
        self._durable = 0
        self._writing: asyncio.Future[None] | None = None
        self._on_disk: bytes | None = None  # what the file holds, when known
        self._encoder = _Encoder()

    def load(self) -> str | None:
        """Read the file. Returns the previous boot id when the node rebooted since it was
        written (the caller marks those claims lost); raises :class:`CheckpointCorrupt`."""
        try:
            loaded = read_durable(self.path, KIND, _parse)
        except Unreadable as err:
            log.error("claims checkpoint unreadable",
                      extra={"kept_at": str(err.kept_at), "error": err.reason})
            raise CheckpointCorrupt(err.kept_at or self.path, err.reason) from err
        if loaded is None:
            return None
        data, self._on_disk = loaded
        previous = data.boot_id if data.boot_id != self.data.boot_id else None
        if previous is not None:
            data.boot_id = self.data.boot_id
            data.tombstones = {}  # they belong to one boot
            data.tombstone_stamps = {}
            for record in data.claims.values():
                record.issued_at_ns = None  # a stamp orders requests of one boot only
        self.data = data
        return previous

    def changed(self) -> None:
        """Note an in-memory change; :meth:`commit` makes it durable."""
        self._version += 1

    def commit(self) -> asyncio.Future[None]:
        """A future done once every change noted so far is on disk. When no write is under
        way, one starts now (not at the first await), so the caller can do other work while
        it is fsync'd; concurrent callers share writes (group commit)."""
        self.changed()
        if self._writing is None or self._writing.done():
            writing = self._start_write()
            # It holds every change so far. Shielded: a caller cancelled while waiting must
            # not cancel a write that others wait for too.
            return asyncio.shield(writing)
        return asyncio.ensure_future(self._until(self._version))

    async def idle(self) -> None:
        """Return once no write is under way (its outcome is its waiters' to see): the node
        stops only then, so nothing writes in the state directory after it has stopped."""
        if self._writing is not None and not self._writing.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writing)

    async def _until(self, target: int) -> None:
        while self._durable < target:
            if self._writing is None or self._writing.done():
                self._start_write()
            assert self._writing is not None
            await asyncio.shield(self._writing)

    def _start_write(self) -> asyncio.Future[None]:
        version = self._version
        data = self._encoder.encode(self.data)
        loop = asyncio.get_running_loop()
        if data == self._on_disk:  # nothing changed since the file was written or read
            self._durable = max(self._durable, version)
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            self._writing = done
            return done
        writing = loop.run_in_executor(None, partial(write_atomic, self.path, data, mode=0o600))
        # Registered before any waiter's wake-up, so it runs first: waiters see _durable moved.
        writing.add_done_callback(partial(self._written, version, data))
        self._writing = writing
        return writing

    def _written(self, version: int, data: bytes, writing: asyncio.Future[None]) -> None:
        if writing.cancelled() or writing.exception() is not None:
            self._on_disk = None  # unknown now: a failed replace may or may not have landed
            return  # the waiters get the error
        self._on_disk = data
        self.fsyncs += 1
        if self._on_write is not None:
            self._on_write()
        self._durable = max(self._durable, version)

    def tombstone(self, uid: str, issued_at_ns: int | None = None) -> None:
        """Note that ``uid`` was unprepared now (oldest first: see :meth:`prune_tombstones`),
        by an unprepare stamped ``issued_at_ns`` (the newest stamp is kept; an unstamped
        unprepare leaves an unstamped tombstone, refused by time alone)."""
        self.data.tombstones.pop(uid, None)
        self.data.tombstones[uid] = time.time()
        stamps = self.data.tombstone_stamps
        if issued_at_ns is None:
            stamps.pop(uid, None)
        else:
            stamps[uid] = max(issued_at_ns, stamps.get(uid, issued_at_ns))

    def drop_tombstone(self, uid: str) -> None:
        """Forget ``uid``'s tombstone (a prepare ordered after its unprepare)."""
        self.data.tombstones.pop(uid, None)
        self.data.tombstone_stamps.pop(uid, None)

    def prune_tombstones(self, window_s: float) -> None:
        """Drop tombstones older than the window. They are kept in the order they were written,
        so this stops at the first one still inside it: it runs on every prepare, and a busy
        node holds thousands."""
        cutoff = time.time() - window_s
        tombstones = self.data.tombstones
        while tombstones:
            uid, at = next(iter(tombstones.items()))
            if at >= cutoff:
                break
            del tombstones[uid]
            self.data.tombstone_stamps.pop(uid, None)

    def cap_tombstones(self, limit: int) -> None:
        """Keep at most ``limit`` tombstones, dropping the oldest: unprepares cannot grow the
        checkpoint without bound."""
        tombstones = self.data.tombstones
        while len(tombstones) > limit:
            uid = next(iter(tombstones))
            del tombstones[uid]
            self.data.tombstone_stamps.pop(uid, None)

    def snapshot(self) -> dict[str, Any]:
        return self.data.model_dump(mode="json")
