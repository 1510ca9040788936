"""Kubelet's PodResources answer as plain values, and the pure mapping from what a container
holds to the agent's devices, keyed as the metrics collector keys its series."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.device_names import gpu_device_name, parse_device_name, profile_label
from agent.gpu.types import Gpu

#: (GPU UUID, GPU instance id or None for the whole GPU): the collector's series key.
DeviceKey = tuple[str, int | None]
#: Per device, the label sets of every container holding it (sorted, no duplicates).
Holders = Mapping[DeviceKey, tuple[Mapping[str, str], ...]]


@dataclass(frozen=True)
class DraDevice:
    """One device of a DRA claim a container references, as kubelet names it."""

    claim_namespace: str
    claim_name: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class ContainerHolding:
    """What one container of one pod holds: device-plugin device IDs of every resource
    (``nvidia.com/gpu`` and the MIG resources list GPU and MIG UUIDs) and DRA devices."""

    namespace: str
    pod: str
    container: str
    device_ids: tuple[str, ...] = ()
    dra: tuple[DraDevice, ...] = ()


def _plugin_id(device_id: str) -> str:
    """A device plugin's ID without a time-slicing replica suffix (``GPU-...::3``)."""
    return device_id.split("::", 1)[0]


def _by_uuid(gpus: Iterable[Gpu]) -> dict[str, DeviceKey]:
    found: dict[str, DeviceKey] = {}
    for gpu in gpus:
        found[gpu.uuid] = (gpu.uuid, None)
        for mig in gpu.mig_devices:
            found[mig.uuid] = (gpu.uuid, mig.gi_id)
    return found


def _by_dra_name(gpus: Sequence[Gpu], name: str) -> DeviceKey | None:
    """Our driver's device name (``gpu-<minor>``, ``gpu-<minor>-mig-<profile>-<id>-<start>``)
    as the GPU or the MIG device now at that placement; None when there is none."""
    parsed = parse_device_name(name)
    if parsed is None:
        return None
    for gpu in gpus:
        if gpu.static.minor != parsed.minor:
            continue
        if parsed.start is None:
            return (gpu.uuid, None) if name == gpu_device_name(gpu.static.minor) else None
        for mig in gpu.mig_devices:
            if (mig.placement.start == parsed.start
                    and profile_label(mig.profile) == parsed.profile):
                return (gpu.uuid, mig.gi_id)
    return None


def holders_by_device(holdings: Iterable[ContainerHolding], gpus: Sequence[Gpu], *,
                      driver: str) -> dict[DeviceKey, tuple[Mapping[str, str], ...]]:
    """The containers holding each of ``gpus``' devices: ``pod``, ``namespace``,
    ``container`` (dcgm-exporter's names), plus ``dra_claim_name``, ``dra_claim_namespace``,
    ``dra_driver_name``, ``dra_pool_name``, ``dra_device_name`` for a DRA device of
    ``driver``. IDs and names that are no device of this node (another driver's, a GPU
    gone) are left out."""
    uuids = _by_uuid(gpus)
    found: dict[DeviceKey, set[tuple[tuple[str, str], ...]]] = {}
    for holding in holdings:
        base = {"container": holding.container, "namespace": holding.namespace,
                "pod": holding.pod}
        for device_id in holding.device_ids:
            key = uuids.get(_plugin_id(device_id))
            if key is not None:
                found.setdefault(key, set()).add(tuple(sorted(base.items())))
        for dra in holding.dra:
            if dra.driver != driver:
                continue
            key = _by_dra_name(gpus, dra.device)
            if key is None:
                continue
            labels = {**base, "dra_claim_name": dra.claim_name,
                      "dra_claim_namespace": dra.claim_namespace,
                      "dra_driver_name": dra.driver, "dra_pool_name": dra.pool,
                      "dra_device_name": dra.device}
            found.setdefault(key, set()).add(tuple(sorted(labels.items())))
    return {key: tuple(sorted((dict(pairs) for pairs in sets), key=_holder_order))
            for key, sets in found.items()}


def _holder_order(labels: Mapping[str, str]) -> tuple[str, ...]:
    """By namespace, pod, container, then the rest: the order a reader expects."""
    return (labels["namespace"], labels["pod"], labels["container"],
            *(f"{k}={v}" for k, v in sorted(labels.items())))
