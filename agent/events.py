"""A bounded ring of recent events that features append to and ``GET /v1/events`` reads, kept
across restarts.

Each start of the agent is an *epoch* (a random id): every event carries the epoch it was
recorded in, and ``/v1/events`` answers with the current one, so a client polling across a
restart sees the epoch change. Sequence numbers keep rising across restarts (the next start
continues after the last event it finds on disk), but an event recorded just before a crash
may never have reached the disk, and its number is then handed out again in the new epoch:
a cursor is the pair ``(epoch, seq)``, and :meth:`EventLog.after` reads from one.

With a ``history`` path the ring is written there (the durable envelope, at most
``capacity`` events and :data:`MAX_HISTORY_BYTES`) by a writer thread, never on the caller's
thread: appends come from the event loop and NVML worker threads and must not wait on fsync.
A burst of events is coalesced into one write.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from agent.durable import Envelope, FileKind, Unreadable, read_durable, write_durable
from agent.errors import StorageUnavailable

log = logging.getLogger("agent.events")

HISTORY_KIND = FileKind("gpu-agent-events", 1)
#: The history file never grows past this: the oldest events are dropped first.
MAX_HISTORY_BYTES = 1 << 20
#: Bursts of events within this long are written once (and at most this much is lost to a
#: SIGKILL).
FLUSH_DELAY_S = 1.0
#: A writer with nothing to write for this long ends (the next event starts another).
WRITER_IDLE_S = 30.0


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    kind: str
    severity: Severity
    message: str
    gpu: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    epoch: str = ""


@dataclass(frozen=True)
class Page:
    """What a reader gets from a cursor: the events after it, and whether the cursor belonged
    to this history at all (``reset``: it did not, and ``events`` is everything retained)."""

    events: list[Event]
    reset: bool


def new_epoch() -> str:
    """A start id: 16 hex digits, unique per start."""
    return secrets.token_hex(8)


def _to_doc(event: Event) -> dict[str, Any]:
    return {"seq": event.seq, "epoch": event.epoch, "time": event.time, "kind": event.kind,
            "severity": str(event.severity), "message": event.message, "gpu": event.gpu,
            "details": dict(event.details)}


def _from_doc(doc: Mapping[str, Any]) -> Event:
    seq, stamp = doc["seq"], doc["time"]
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"event seq {seq!r} is not a positive integer")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float):
        raise ValueError(f"event time {stamp!r} is not a number")
    details = doc.get("details") or {}
    if not isinstance(details, dict):
        raise ValueError("event details are not an object")
    gpu = doc.get("gpu")
    return Event(seq=seq, time=float(stamp), kind=str(doc["kind"]),
                 severity=Severity(doc["severity"]), message=str(doc["message"]),
                 gpu=None if gpu is None else str(gpu), details=details,
                 epoch=str(doc.get("epoch", "")))


def _parse_history(envelope: Envelope) -> list[Event]:
    payload = envelope.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("events"), list):
        raise ValueError("not an {'events': [...]} object")
    return [_from_doc(doc) for doc in payload["events"]]


class EventLog:
    """Thread-safe: NVML worker threads append too. Sequence numbers never repeat within an
    epoch and rise across epochs (see the module docstring for the one exception)."""

    def __init__(self, capacity: int = 1000, *, history: Path | None = None) -> None:
        self.epoch = new_epoch()
        self.capacity = capacity
        self._history = history
        self._lock = threading.Condition()  # the ring, and the writer's wake-up
        loaded = self._load() if history is not None else []
        self._events: deque[Event] = deque(loaded[-capacity:], maxlen=capacity)
        self._seq = itertools.count(max((e.seq for e in loaded), default=0) + 1)
        self._dirty = False  # events the file does not hold yet
        self._closing = threading.Event()
        self._writer: threading.Thread | None = None
        self._encoded: dict[int, str] = {}  # the writer's cache: seq -> the event's JSON

    def _load(self) -> list[Event]:
        assert self._history is not None
        try:
            return read_durable(self._history, HISTORY_KIND, _parse_history) or []
        except Unreadable as err:
            # The history only informs; an unreadable one is kept aside and started afresh.
            log.warning("event history unreadable; starting a new one",
                        extra={"error": str(err)})
            return []

    def append(
        self,
        kind: str,
        message: str,
        *,
        severity: Severity = Severity.INFO,
        gpu: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Event:
        """Record an event and log it as one line (its GPU, or the GPUs in ``details["gpus"]``,
        in the line's ``gpu`` field)."""
        with self._lock:
            event = Event(next(self._seq), time.time(), kind, severity, message, gpu,
                          dict(details or {}), self.epoch)
            self._events.append(event)
            if self._history is not None:
                self._schedule_write()
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING,
                 Severity.ERROR: logging.ERROR}[severity]
        log.log(level, message, extra={"event": kind, "seq": event.seq, "gpu": _gpus(event)})
        return event

    def since(self, seq: int = 0) -> list[Event]:
        """Events with a sequence number greater than ``seq``, oldest first."""
        with self._lock:
            return [e for e in self._events if e.seq > seq]

    @property
    def last_seq(self) -> int:
        """The newest event's sequence number (0 when there is none)."""
        with self._lock:
            return self._events[-1].seq if self._events else 0

    def after(self, seq: int, epoch: str | None = None) -> Page:
        """The events after the cursor ``(epoch, seq)``; without ``epoch``, ``seq`` counts in
        the current epoch. A cursor this history cannot place (a ``seq`` beyond the newest
        event, or an epoch no longer retained) is a reset: everything retained is returned."""
        with self._lock:
            events = list(self._events)
        last = events[-1].seq if events else 0
        if epoch is None or epoch == self.epoch:
            if seq > last:
                return Page(events, reset=True)
            return Page([e for e in events if e.seq > seq], reset=False)
        # An earlier epoch: everything recorded after that epoch's event ``seq``.
        position = None
        for i, event in enumerate(events):
            if event.epoch == epoch and event.seq <= seq:
                position = i
        if position is None:
            return Page(events, reset=True)
        return Page(events[position + 1:], reset=False)

    # -- the history on disk ----------------------------------------------------------------

    def _schedule_write(self) -> None:
        """With the lock held: mark the file behind, and wake (or start) the writer."""
        self._dirty = True
        if self._writer is None and not self._closing.is_set():
            self._writer = threading.Thread(target=self._write_loop, name="event-history",
                                            daemon=True)
            self._writer.start()
        self._lock.notify()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                if not self._dirty and not self._closing.is_set():
                    self._lock.wait(WRITER_IDLE_S)
                if not self._dirty:
                    self._writer = None  # idle or closed: the next append starts another
                    return
            self._closing.wait(FLUSH_DELAY_S)  # coalesce a burst into one write
            self.flush()

    def flush(self) -> None:
        """Write the retained events now (the writer thread calls this; so does close).
        A full or failing disk is logged, never raised: the history only informs."""
        if self._history is None:
            return
        with self._lock:
            events = list(self._events)
            self._dirty = False
        cache = self._encoded
        lines = [cache.get(e.seq) or json.dumps(_to_doc(e), default=str, separators=(",", ":"))
                 for e in events]
        self._encoded = {e.seq: line for e, line in zip(events, lines, strict=True)}
        payload = _bounded(lines)
        try:
            write_durable(self._history, HISTORY_KIND, payload)
        except StorageUnavailable as err:
            log.warning("event history not written", extra={"error": err.detail})

    def close(self, timeout: float = 5.0) -> None:
        """Write what is pending and stop the writer (at shutdown, after the last event)."""
        with self._lock:
            self._closing.set()
            self._lock.notify()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)
        with self._lock:
            pending = self._dirty and self._writer is None
        if pending:
            self.flush()


def _bounded(lines: list[str]) -> bytes:
    """The payload of at most :data:`MAX_HISTORY_BYTES`, dropping the oldest events."""
    size = len('{"events":[]}') + sum(map(len, lines)) + 2 * len(lines)  # ",\n" between
    start = 0
    while size > MAX_HISTORY_BYTES and start < len(lines):
        size -= len(lines[start]) + 2
        start += 1
    return ('{"events":[' + ",\n".join(lines[start:]) + "]}").encode()


def _gpus(event: Event) -> str:
    if event.gpu:
        return event.gpu
    gpus = event.details.get("gpus")
    if isinstance(gpus, list | tuple) and gpus:
        return ",".join(str(g) for g in gpus)
    return "-"
