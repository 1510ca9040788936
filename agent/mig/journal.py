"""The transition journal: what was in flight on each GPU, durable before the first mutation.

One file per GPU with an open transition (``<dir>/<gpu-uuid>.json``): the old geometry with
placements and CI profiles, the plan, the step about to run and the steps done. The file is
replaced atomically at every step and removed when the transition ends; a checksum over the
entry catches torn or corrupted files, which are kept aside and reported, never trusted.
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

from pydantic import BaseModel, ConfigDict, ValidationError

from agent.durable import fsync_dir, keep_aside, write_atomic
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


@dataclass(frozen=True)
class CorruptEntry:
    """A journal file that could not be trusted, and where it was kept aside."""

    gpu: str
    kept_at: Path
    reason: str


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class TransitionJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, gpu: str) -> Path:
        return self.directory / f"{gpu}.json"

    def write(self, entry: JournalEntry) -> None:
        """Record the entry durably (fsync) before the caller touches the hardware."""
        payload = entry.model_dump(mode="json")
        data = {"sha256": _digest(payload), "entry": payload}
        write_atomic(self._path(entry.gpu), json.dumps(data, indent=1).encode())

    def close(self, gpu: str) -> None:
        """The transition on ``gpu`` ended: remove its entry durably."""
        try:
            self._path(gpu).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.directory)

    def open_entries(self) -> tuple[list[JournalEntry], list[CorruptEntry]]:
        """Every open entry; unreadable ones are moved aside and returned separately."""
        entries: list[JournalEntry] = []
        corrupt: list[CorruptEntry] = []
        if not self.directory.is_dir():
            return entries, corrupt
        for path in sorted(self.directory.glob("*.json")):
            gpu = path.stem
            try:
                doc = json.loads(path.read_bytes())
                payload = doc["entry"]
                if doc.get("sha256") != _digest(payload):
                    raise ValueError("checksum mismatch")
                entries.append(JournalEntry.model_validate(payload))
            except (ValueError, KeyError, TypeError, ValidationError, UnicodeDecodeError) as err:
                reason = "checksum" if "checksum" in str(err) else "unreadable"
                kept = keep_aside(path, reason)
                log.error("corrupt journal entry kept aside",
                          extra={"gpu": gpu, "kept_at": str(kept), "error": str(err)[:200]})
                corrupt.append(CorruptEntry(gpu, kept, f"{reason}: {str(err)[:200]}"))
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
