"""A MIG transition as a value the API shows: one state Enum, the steps with timings, blockers.

```
requested → planned → draining → applying → verifying → succeeded
                 └─(drain timeout / cancel)→ aborted            (nothing changed)
                              applying fails → rolling_back → rolled_back
                                                       └─(rollback fails) → failed
                              MIG mode change needs a GPU reset → pending_reset
```
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from agent.mig.geometry import Plan


class TransitionState(StrEnum):
    REQUESTED = "requested"
    PLANNED = "planned"
    DRAINING = "draining"
    APPLYING = "applying"
    VERIFYING = "verifying"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    PENDING_RESET = "pending_reset"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({TransitionState.SUCCEEDED, TransitionState.ABORTED,
                      TransitionState.ROLLED_BACK, TransitionState.FAILED,
                      TransitionState.PENDING_RESET})


@dataclass(frozen=True)
class DrainPolicy:
    """``fail``: refuse at once while an instance to destroy is in use; ``wait``: wait up to
    ``timeout_s`` for it to become free."""

    policy: Literal["fail", "wait"] = "fail"
    timeout_s: float = 0.0


@dataclass(frozen=True)
class Blocker:
    """Something that keeps an instance the plan destroys in use."""

    instance: str
    kind: Literal["process", "claim"]
    id: str


@dataclass
class StepRecord:
    name: str
    started_at: float
    finished_at: float | None = None
    result: str | None = None
    error: str | None = None


@dataclass
class Transition:
    """One GPU's change from its current geometry to a desired one. Mutated only by the
    transition manager, on the event loop."""

    id: str
    gpu: str
    gpu_index: int
    requested: str
    plan: Plan
    drain: DrainPolicy
    state: TransitionState = TransitionState.REQUESTED
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    steps: list[StepRecord] = field(default_factory=list)
    blockers: list[Blocker] = field(default_factory=list)
    error: str | None = None
    #: The exception behind ``error``, for a caller that re-raises it (a slice's claim).
    cause: Exception | None = field(default=None, repr=False, compare=False)
    apply_id: str | None = None
    history: list[tuple[TransitionState, float]] = field(default_factory=list)
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.history.append((self.state, self.created_at))

    def advance(self, state: TransitionState) -> None:
        """Move to ``state`` (every state change goes through here)."""
        self.state = state
        now = time.time()
        self.history.append((state, now))
        if state.terminal:
            self.finished_at = now
            self.finished.set()

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created_at
