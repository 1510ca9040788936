"""A bounded ring of recent events that features append to and ``GET /v1/events`` reads."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

log = logging.getLogger("agent.events")


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


class EventLog:
    """Thread-safe: NVML worker threads append too. Sequence numbers start at 1 and never repeat
    within a process; ``since`` lets a poller resume where it stopped."""

    def __init__(self, capacity: int = 1000) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def append(
        self,
        kind: str,
        message: str,
        *,
        severity: Severity = Severity.INFO,
        gpu: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Event:
        """Record an event and log it as one line."""
        with self._lock:
            event = Event(next(self._seq), time.time(), kind, severity, message, gpu,
                          dict(details or {}))
            self._events.append(event)
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING,
                 Severity.ERROR: logging.ERROR}[severity]
        log.log(level, message, extra={"event": kind, "seq": event.seq, "gpu": gpu or "-"})
        return event

    def since(self, seq: int = 0) -> list[Event]:
        """Events with a sequence number greater than ``seq``, oldest first."""
        with self._lock:
            return [e for e in self._events if e.seq > seq]
