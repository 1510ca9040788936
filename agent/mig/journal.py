"""The transition journal: what was in flight on each GPU, durable before the first mutation.

One file per GPU with an open transition (``<dir>/<gpu-uuid>.json``): the old geometry with
placements and CI profiles, the plan, the step about to run and the steps done. Each is a
durable envelope (:mod:`agent.durable`) replaced atomically at every step and removed when
the transition ends; its checksum catches torn or corrupted files, which are kept aside and
reported, never trusted. Entries written before the envelope (``{"sha256", "entry"}``) are
still read. Downgrade: an agent from before the envelope cannot parse a new entry; it keeps
it aside as corrupt and quarantines that GPU (fail closed; it starts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agent.durable import (
    Envelope,
    FileKind,
    Unreadable,
    dump_payload,
    fsync_dir,
    keep_aside,
    read_durable,
    write_durable,
)
from agent.mig.geometry import Geometry, Plan

log = logging.getLogger("agent.mig.journal")
SCHEMA_VERSION = 1


class JournalEntry(BaseModel):
    """One open transition. Unknown fields (from a newer agent) are ignored, so an upgrade or
    a downgrade never crash-loops on the journal."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    transition_id: str
    gpu: str
    old: dict[str, Any]
    old_ci_profiles: dict[str, list[int]]
    plan: dict[str, Any]
    phase: Literal["applying", "rolling_back"] = "applying"
    next_step: str | None = None
    done: list[str] = []
    started_at: float
    #: An on-demand slice made or destroyed for a claim: not part of the desired geometry.
    on_demand: bool = False

    def old_geometry(self) -> Geometry:
        return Geometry.from_dict(self.old)

    def the_plan(self) -> Plan:
        return Plan.from_dict(self.plan)


ALL_GPUS = "*"
"""``CorruptEntry.gpu`` when the journal directory itself was unreadable: any GPU may have
had a transition in flight."""


@dataclass(frozen=True)
class CorruptEntry:
    """A journal file that could not be trusted, and where it was kept aside (``gpu`` is
    :data:`ALL_GPUS` when the directory itself was not a directory)."""

    gpu: str
    kept_at: Path
    reason: str


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _legacy_entry(document: Any) -> Any:
    """An entry from before the envelope: ``{"sha256": <canonical digest>, "entry": {...}}``."""
    if not isinstance(document, dict) or not isinstance(document.get("entry"), dict):
        raise ValueError("not a {'sha256', 'entry'} object")
    if document.get("sha256") != _digest(document["entry"]):
        raise ValueError("checksum mismatch")
    return document["entry"]


KIND = FileKind("gpu-agent-mig-journal", SCHEMA_VERSION, legacy=_legacy_entry)


def _parse(envelope: Envelope) -> JournalEntry:
    return JournalEntry.model_validate(envelope.payload)


class TransitionJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, gpu: str) -> Path:
        return self.directory / f"{gpu}.json"

    def write(self, entry: JournalEntry) -> None:
        """Record the entry durably (fsync) before the caller touches the hardware."""
        write_durable(self._path(entry.gpu), KIND, dump_payload(entry.model_dump(mode="json")))

    def close(self, gpu: str) -> None:
        """The transition on ``gpu`` ended: remove its entry durably."""
        try:
            self._path(gpu).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.directory)

    def open_entries(self) -> tuple[list[JournalEntry], list[CorruptEntry]]:
        """Every open entry; unreadable ones are moved aside and returned separately. A
        journal path that is not a directory is moved aside too, reported as one corrupt
        entry for :data:`ALL_GPUS`."""
        entries: list[JournalEntry] = []
        corrupt: list[CorruptEntry] = []
        if os.path.lexists(self.directory) and not self.directory.is_dir():
            reason = "the journal directory is not a directory"
            try:
                kept = keep_aside(self.directory, "unreadable")
            except OSError as err:
                kept, reason = self.directory, f"{reason}; could not be moved aside: {err}"
            log.error("journal directory unreadable", extra={"kept_at": str(kept)})
            return entries, [CorruptEntry(ALL_GPUS, kept, reason)]
        if not self.directory.is_dir():
            return entries, corrupt
        for path in sorted(self.directory.glob("*.json")):
            gpu = path.stem
            try:
                entry = read_durable(path, KIND, _parse)
            except Unreadable as err:
                log.error("corrupt journal entry kept aside",
                          extra={"gpu": gpu, "kept_at": str(err.kept_at), "error": err.reason})
                corrupt.append(CorruptEntry(gpu, err.kept_at or path,
                                            f"{err.suffix}: {err.reason}"))
                continue
            if entry is not None:  # None: removed since the listing
                entries.append(entry)
        return entries, corrupt


def new_entry(*, transition_id: str, gpu: str, old: Geometry,
              old_ci_profiles: dict[str, list[int]], plan: Plan,
              on_demand: bool = False) -> JournalEntry:
    return JournalEntry(transition_id=transition_id, gpu=gpu, old=old.to_dict(),
                        old_ci_profiles=old_ci_profiles, plan=plan.to_dict(),
                        started_at=time.time(), on_demand=on_demand)


def ensure_directory(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
