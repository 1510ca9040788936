"""Why the agent is not ready yet, and whether its state is reconciled."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Readiness:
    """``reason`` is ``None`` once the agent is ready. ``reconciled`` turns true once journal
    recovery and claim reconciliation have finished: before that no mutation and no read of
    reconciled state is served (the API answers 503 with Retry-After)."""

    reason: str | None = "starting"
    since: float = field(default_factory=time.monotonic)
    reconciled: bool = False
    #: Recovery waits for a durable write the state directory refuses (errno, path): writes
    #: answer that (507) rather than "not ready", since it is what the operator must fix.
    storage_blocked: tuple[int, str] | None = None
    #: Called with the new reason on every change (e.g. systemd's STATUS= lines).
    watchers: list[Callable[[str | None], None]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.reason is None

    def set(self, reason: str | None) -> None:
        if reason != self.reason:
            self.reason = reason
            self.since = time.monotonic()
            for watcher in self.watchers:
                watcher(reason)
