"""The MIG transitions ``GET /v1/transitions`` shows, bounded and kept across restarts.

Finished transitions (terminal states) are written to ``<state>/mig/transitions.json`` in the
durable envelope (format ``gpu-agent-mig-transitions``), at most :data:`HISTORY` of them and
:data:`MAX_HISTORY_BYTES`, oldest dropped first. A transition still running is not written:
if the agent dies during it, the journal resolves it at the next start, and that recovery is
a finished transition of its own (same id) that is written then.

Writes run in a thread, never on the event loop (they fsync), one at a time, a burst of
finishes coalesced into one write. The history only informs (nothing is decided from it), so
an unreadable file does not stop the agent: it is kept aside by the envelope reader, the
history starts empty, and ``problem`` says so for the caller to report as a warning event.
A failed write (full disk) is logged, never raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.durable import Envelope, FileKind, Unreadable, read_durable, write_durable
from agent.errors import StorageUnavailable
from agent.mig.geometry import Plan
from agent.mig.transition import (
    Blocker,
    DrainPolicy,
    StepRecord,
    Transition,
    TransitionState,
)

log = logging.getLogger("agent.mig")

HISTORY_KIND = FileKind("gpu-agent-mig-transitions", 1)
#: Transitions kept (in memory and on disk), newest kept.
HISTORY = 500
#: The file never grows past this: the oldest transitions are dropped first.
MAX_HISTORY_BYTES = 1 << 20


def transition_doc(t: Transition) -> dict[str, Any]:
    """A transition as the history file holds it."""
    return {"id": t.id, "gpu": t.gpu, "gpu_index": t.gpu_index, "requested": t.requested,
            "plan": t.plan.to_dict(),
            "drain": {"policy": t.drain.policy, "timeout_s": t.drain.timeout_s},
            "state": t.state.value, "created_at": t.created_at, "finished_at": t.finished_at,
            "steps": [{"name": s.name, "started_at": s.started_at, "finished_at": s.finished_at,
                       "result": s.result, "error": s.error} for s in t.steps],
            "blockers": [{"instance": b.instance, "kind": b.kind, "id": b.id}
                         for b in t.blockers],
            "error": t.error, "apply_id": t.apply_id,
            "history": [[state.value, at] for state, at in t.history]}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} {value!r} is not a number")
    return float(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def transition_of(doc: Mapping[str, Any]) -> Transition:
    """A finished transition from its history document (:class:`ValueError`,
    :class:`KeyError` or :class:`TypeError` when it is not one)."""
    state = TransitionState(doc["state"])
    if not state.terminal:
        raise ValueError(f"transition {doc['id']!r} is {state}, not finished")
    drain = doc["drain"]
    policy = drain["policy"]
    if policy not in ("fail", "wait"):
        raise ValueError(f"drain policy {policy!r}")
    index = doc["gpu_index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"gpu_index {index!r} is not an integer")
    t = Transition(id=str(doc["id"]), gpu=str(doc["gpu"]), gpu_index=index,
                   requested=str(doc["requested"]), plan=Plan.from_dict(doc["plan"]),
                   drain=DrainPolicy(policy, _number(drain["timeout_s"], "timeout_s")),
                   state=state, created_at=_number(doc["created_at"], "created_at"),
                   error=_optional_text(doc.get("error")),
                   apply_id=_optional_text(doc.get("apply_id")))
    finished = doc.get("finished_at")
    t.finished_at = None if finished is None else _number(finished, "finished_at")
    t.steps = [StepRecord(name=str(s["name"]), started_at=_number(s["started_at"], "started_at"),
                          finished_at=None if s.get("finished_at") is None
                          else _number(s["finished_at"], "finished_at"),
                          result=_optional_text(s.get("result")),
                          error=_optional_text(s.get("error"))) for s in doc.get("steps", [])]
    t.blockers = [Blocker(instance=str(b["instance"]), kind=_blocker_kind(b["kind"]),
                          id=str(b["id"])) for b in doc.get("blockers", [])]
    t.history = [(TransitionState(s), _number(at, "history time"))
                 for s, at in doc.get("history", [])]
    t.finished.set()
    return t


def _blocker_kind(kind: Any) -> Any:
    if kind not in ("process", "claim"):
        raise ValueError(f"blocker kind {kind!r}")
    return kind


def _parse(envelope: Envelope) -> list[Transition]:
    payload = envelope.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("transitions"), list):
        raise ValueError("not a {'transitions': [...]} object")
    return [transition_of(doc) for doc in payload["transitions"]]


def _bounded(lines: Sequence[str]) -> bytes:
    """The payload of at most :data:`MAX_HISTORY_BYTES`, dropping the oldest transitions."""
    size = len('{"transitions":[]}') + sum(len(line) + 2 for line in lines)  # ",\n" between
    start = 0
    while size > MAX_HISTORY_BYTES and start < len(lines):
        size -= len(lines[start]) + 2
        start += 1
    return ('{"transitions":[' + ",\n".join(lines[start:]) + "]}").encode()


class TransitionHistory:
    """Transitions by id, oldest first, at most ``capacity``; finished ones kept on disk at
    ``path`` (none without one). Used on the event loop only."""

    def __init__(self, path: Path | None, capacity: int = HISTORY) -> None:
        self.path = path
        self.capacity = capacity
        #: Why the file on disk could not be used (it was kept aside), or None.
        self.problem: str | None = None
        self._items: OrderedDict[str, Transition] = OrderedDict()
        self._dirty = False
        self._writer: asyncio.Task[None] | None = None
        # The writer's cache: a finished transition's JSON by (id, finished_at); recovery can
        # finish a second transition under an id already finished before a crash.
        self._encoded: dict[tuple[str, float | None], str] = {}
        if path is not None:
            try:
                loaded = read_durable(path, HISTORY_KIND, _parse) or []
            except Unreadable as err:
                self.problem = str(err)
                loaded = []
            for t in loaded[-capacity:]:
                self._items[t.id] = t

    def remember(self, t: Transition) -> None:
        """Add (or replace) ``t``; the oldest beyond ``capacity`` are dropped."""
        self._items[t.id] = t
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, transition_id: str) -> Transition | None:
        return self._items.get(transition_id)

    def newest_first(self) -> list[Transition]:
        return list(reversed(self._items.values()))

    def finished(self, t: Transition) -> None:
        """``t`` reached a terminal state: write the history soon (in a thread)."""
        self.remember(t)
        if self.path is None:
            return
        self._dirty = True
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def _write_loop(self) -> None:
        while self._dirty:
            self._dirty = False
            # Finished transitions are not changed any more, so the thread may read them.
            done = [t for t in self._items.values() if t.state.terminal]
            try:
                await asyncio.to_thread(self._write, done)
            except StorageUnavailable as err:
                log.warning("MIG transition history not written", extra={"error": err.detail})

    def _write(self, done: list[Transition]) -> None:
        assert self.path is not None
        cache = self._encoded
        lines = [cache.get((t.id, t.finished_at))
                 or json.dumps(transition_doc(t), separators=(",", ":")) for t in done]
        self._encoded = {(t.id, t.finished_at): line for t, line in zip(done, lines, strict=True)}
        write_durable(self.path, HISTORY_KIND, _bounded(lines))

    async def close(self) -> None:
        """Wait for the write in flight (and any it left pending) to reach the disk."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)
