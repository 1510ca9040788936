"""Which claim holds each device, as the labels metrics attribute a device's series to. The
collector receives this as a callable, so metrics never reads claims itself."""

from __future__ import annotations

from collections.abc import Iterable

from agent.claims.checkpoint import ClaimRecord


def claim_attribution(records: Iterable[ClaimRecord]) -> dict[tuple[str, int | None],
                                                               dict[str, str]]:
    """Attribution labels of prepared claims, keyed by (GPU UUID, GPU instance id or None for
    the whole GPU): ``namespace``, ``pod``, ``container`` from the claim's metadata when given,
    and ``claim_uid``. A device held by several claims gets the oldest one's (records come
    oldest first)."""
    found: dict[tuple[str, int | None], dict[str, str]] = {}
    for record in records:
        if record.state != "prepare_completed":
            continue
        labels = {k: record.metadata[k] for k in ("namespace", "pod", "container")
                  if record.metadata.get(k)}
        labels["claim_uid"] = record.uid
        for device in record.devices:
            key = (device.gpu, device.gi_id if device.kind == "mig" else None)
            found.setdefault(key, labels)
    return found
