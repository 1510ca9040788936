"""A GPU's faults as the agent keeps them across restarts (pure: values in, values out).

The health state file (``<state>/health/faults.json``) holds, per GPU UUID, its index and
minor (so a GPU lost before the next start, which NVML then names by no UUID, is still known
as the same device) and its faults. What survives which event:

- an agent restart (same boot id): every fault, with its ``since`` (the taint's
  ``timeAdded`` does not move);
- a reboot (the boot id changed): nothing of XIDs or lost GPUs (a reboot resets every GPU);
  the fail-closed ``quarantined`` faults of unreadable health state stay until an operator
  clears them (they were never about the GPU's state, but about the agent's knowledge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.health.taints import Fault, RecoveryAction

KINDS = ("xid", "gpu-lost", "unmonitored", "quarantined", "drain", "fabric", "fabric-health")
#: Faults a reboot clears (a reboot resets the GPUs).
RESET_BY_REBOOT = frozenset({"xid", "gpu-lost"})


@dataclass(frozen=True)
class GpuRecord:
    """One GPU in the health state file: its identity and its durable faults."""

    uuid: str
    index: int
    minor: int
    faults: tuple[Fault, ...]


def recovery_action(value: object) -> RecoveryAction | None:
    """The driver's recovery action as the schema names it; None when it did not say (or
    said a value this agent does not know, which is classified by the XID table)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    try:
        return RecoveryAction(value)
    except ValueError:
        return None


def encode_fault(fault: Fault) -> dict[str, Any]:
    """A fault as JSON (its fields; no ``None`` values)."""
    doc: dict[str, Any] = {"kind": fault.kind, "reason": fault.reason, "since": fault.since}
    for name in ("value", "gi_id", "ci_id"):
        value = getattr(fault, name)
        if value is not None:
            doc[name] = value
    if fault.recovery_action is not None:
        doc["recovery_action"] = int(fault.recovery_action)
    return doc


def decode_fault(doc: Any) -> Fault:
    """A fault from :func:`encode_fault`'s JSON; :class:`ValueError` when it is not one."""
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        raise ValueError(f"not a fault: {str(doc)[:80]}")
    since, reason = doc.get("since"), doc.get("reason")
    if isinstance(since, bool) or not isinstance(since, int | float) \
            or not isinstance(reason, str):
        raise ValueError(f"fault without since or reason: {str(doc)[:80]}")
    value = doc.get("value")
    ids = [doc.get("gi_id"), doc.get("ci_id")]
    if (value is not None and not isinstance(value, str)) or any(
            i is not None and (isinstance(i, bool) or not isinstance(i, int)) for i in ids):
        raise ValueError(f"fault with a bad value or instance: {str(doc)[:80]}")
    return Fault(kind=doc["kind"], reason=reason, since=float(since), value=value,
                 gi_id=ids[0], ci_id=ids[1],
                 recovery_action=recovery_action(doc.get("recovery_action")))


def encode_state(boot_id: str, records: list[GpuRecord]) -> dict[str, Any]:
    """The health state file's payload."""
    return {"boot_id": boot_id, "gpus": {
        r.uuid: {"index": r.index, "minor": r.minor,
                 "faults": [encode_fault(f) for f in r.faults]}
        for r in sorted(records, key=lambda r: r.uuid)}}


def decode_state(payload: Any, boot_id: str) -> dict[str, GpuRecord]:
    """The records of the payload, by UUID, less what a reboot cleared when ``boot_id`` is
    not the one it was written in. :class:`ValueError` when the payload is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("gpus"), dict):
        raise ValueError("not a {'boot_id', 'gpus': {...}} object")
    rebooted = payload.get("boot_id") != boot_id
    records: dict[str, GpuRecord] = {}
    for uuid, doc in payload["gpus"].items():
        if not isinstance(doc, dict) or not isinstance(doc.get("faults"), list):
            raise ValueError(f"GPU {uuid!r}: not a record")
        index, minor = doc.get("index", -1), doc.get("minor", -1)
        if isinstance(index, bool) or not isinstance(index, int) or isinstance(minor, bool) \
                or not isinstance(minor, int):
            raise ValueError(f"GPU {uuid!r}: bad index or minor")
        faults = tuple(f for f in map(decode_fault, doc["faults"])
                       if not (rebooted and f.kind in RESET_BY_REBOOT))
        if faults:
            records[uuid] = GpuRecord(uuid=uuid, index=index, minor=minor, faults=faults)
    return records
