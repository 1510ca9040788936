"""Which claim holds each device, as the labels metrics attribute a device's series to. The
collector receives these as callables, so metrics never reads claims itself."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.claims.checkpoint import ClaimRecord, PreparedDevice
from agent.metrics.collector import ShareSeries


def _labels(record: ClaimRecord) -> dict[str, str]:
    labels = {k: record.metadata[k] for k in ("namespace", "pod", "container")
              if record.metadata.get(k)}
    labels["claim_uid"] = record.uid
    return labels


def _counted_share(device: PreparedDevice) -> bool:
    return device.kind == "gpu" and device.share is not None and device.share.counted


def claim_attribution(records: Iterable[ClaimRecord]) -> dict[tuple[str, int | None],
                                                               dict[str, str]]:
    """Attribution labels of prepared claims, keyed by (GPU UUID, GPU instance id or None for
    the whole GPU): ``namespace``, ``pod``, ``container`` from the claim's metadata when given,
    and ``claim_uid``. A device held by several claims gets the oldest one's (records come
    oldest first). Counted shares of a GPU are left to :func:`share_attribution`: no one
    share's claim stands for the whole GPU."""
    found: dict[tuple[str, int | None], dict[str, str]] = {}
    for record in records:
        if record.state != "prepare_completed":
            continue
        labels = _labels(record)
        for device in record.devices:
            if _counted_share(device):
                continue
            key = (device.gpu, device.gi_id if device.kind == "mig" else None)
            found.setdefault(key, labels)
    return found


def share_attribution(records: Iterable[ClaimRecord],
                      used: Mapping[tuple[str, str], int]) -> dict[str, list[ShareSeries]]:
    """Per GPU UUID, a series of each prepared claim holding a counted share of it (oldest
    first): the claim's attribution labels, its share, and the memory its MPS clients use
    (``used``, keyed by claim UID and GPU UUID; absent when it could not be read). The claim
    name and namespace pick its containers out of kubelet's PodResources holders."""
    found: dict[str, list[ShareSeries]] = {}
    for record in records:
        if record.state != "prepare_completed":
            continue
        match = {k: v for k, v in (("dra_claim_namespace", record.metadata.get("namespace")),
                                   ("dra_claim_name", record.metadata.get("name"))) if v}
        for device in record.devices:
            if not _counted_share(device) or device.share is None:
                continue
            found.setdefault(device.gpu, []).append(ShareSeries(
                labels=_labels(record), share_mib=device.share.memory_mib,
                used_mib=used.get((record.uid, device.gpu)), holder_match=match))
    return found
