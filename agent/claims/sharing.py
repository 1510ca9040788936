"""GPU sharing for one claim, decided without touching anything: which devices run under MPS
(and with which limits), which are time-sliced, which hold a counted share of a GPU's memory.

:func:`plan` checks a claim's sharing requests against the devices they resolved to and
returns a frozen :class:`SharingPlan`, or raises :class:`InvalidRequest` naming every
offending field at once (``devices[1].sharing.mpsConfig.defaultActiveThreadPercentage``). The
claims service applies the plan afterwards (``agent/claims/sharing_runtime.py``); nothing here
does I/O.

The rules (docs/sharing.md):
- ``TimeSlicing`` applies to full GPUs only (the interval is GPU-wide): refused on a MIG device
  and on a share of a GPU;
- ``MPS`` applies to full GPUs (held exclusively, compute mode ``EXCLUSIVE_PROCESS``) and to
  MIG devices (compute mode untouched); one control daemon per claim serves all its MPS
  devices, so they must agree on ``defaultActiveThreadPercentage`` (a daemon-wide default);
- a pinned memory limit is at most the device's memory (a share's: the share);
- a ``capacity`` request is a counted share of a full GPU with MIG off: all of the GPU's
  shareable memory is the whole GPU (an exclusive hold, no implicit MPS); less is enforced
  with MPS: pinned limit = the share, threads = max(1, floor(100 * share / shareable)) unless
  configured, the GPU left in compute mode ``DEFAULT`` so several claims' daemons share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.device_names import shareable_mib
from agent.errors import InvalidRequest

Strategy = Literal["TimeSlicing", "MPS"]
Interval = Literal["Default", "Short", "Medium", "Long"]
#: ``nvidia-smi compute-policy --set-timeslice`` values (NVIDIA's DRA driver's mapping).
TIMESLICE_VALUES: Mapping[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
#: The counted capacity a memory share takes in the ledger.
MEMORY_MIB = "memory_mib"


@dataclass(frozen=True)
class MpsConfig:
    """``mpsConfig``: limits in MiB; ``per_device_mib`` keys are UUIDs or indices into the
    claim's sorted MPS device UUIDs, as NVIDIA's driver reads them."""

    thread_percentage: int | None = None
    pinned_mib: int | None = None
    per_device_mib: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SharingConfig:
    """A request's ``sharing``: the strategy and its one config."""

    strategy: Strategy
    interval: Interval | None = None
    mps: MpsConfig | None = None


@dataclass(frozen=True)
class Target:
    """One device of the claim as resolved, with what its request asked for."""

    position: int
    uuid: str
    gpu: str
    kind: Literal["gpu", "mig"]
    memory_mib: int
    mig_enabled: bool = False
    sharing: SharingConfig | None = None
    memory_share_mib: int | None = None
    admin_access: bool = False


@dataclass(frozen=True)
class DevicePlan:
    """What the claim does to one device. ``share_mib`` set: a counted share of the GPU (the
    ledger holds it against ``shareable_mib``); None: exclusive (or admin)."""

    position: int
    uuid: str
    gpu: str
    strategy: Strategy | None = None
    timeslice: int | None = None
    interval: Interval | None = None
    exclusive_process: bool = False
    thread_percentage: int | None = None
    pinned_mib: int | None = None
    share_mib: int | None = None
    shareable_mib: int | None = None


@dataclass(frozen=True)
class DaemonIntent:
    """The claim's one MPS control daemon: its devices (UUIDs, sorted) and limits."""

    devices: tuple[str, ...]
    thread_percentage: int | None
    pinned_limits_mib: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SharingPlan:
    devices: tuple[DevicePlan, ...] = ()
    daemon: DaemonIntent | None = None

    @property
    def needs_nvidia_smi(self) -> bool:
        return any(d.timeslice is not None or d.exclusive_process for d in self.devices)

    def device(self, position: int) -> DevicePlan | None:
        return next((d for d in self.devices if d.position == position), None)


@dataclass
class _Errors:
    items: list[dict[str, Any]] = field(default_factory=list)

    def add(self, position: int, path: str, reason: str) -> None:
        self.items.append({"field": f"devices[{position}].{path}", "reason": reason})


def short_id(uid: str) -> str:
    """A claim's MPS directory name: 12 hex digits of SHA-256 of its UID (fixed length, and
    no character of the UID reaches a path)."""
    return hashlib.sha256(uid.encode()).hexdigest()[:12]


def daemon_root(mps_root: Path, uid: str) -> Path:
    return mps_root / short_id(uid)


def implicit_threads(share_mib: int, shareable: int) -> int:
    """The thread percentage a share gets unless configured: proportional, at least 1."""
    return max(1, 100 * share_mib // shareable) if shareable > 0 else 1


def plan(targets: Sequence[Target], *, dynamic_mig: bool = False) -> SharingPlan:
    """The claim's sharing plan, or :class:`InvalidRequest` listing every offending field."""
    errors = _Errors()
    mps_uuids = sorted(t.uuid for t in targets if _mps(t))
    devices: list[DevicePlan] = []
    configured_threads: dict[int, int] = {}
    for target in targets:
        device = _device_plan(target, mps_uuids, errors, dynamic_mig=dynamic_mig)
        if device is not None:
            devices.append(device)
            mps = target.sharing.mps if target.sharing is not None else None
            if device.strategy == "MPS" and mps is not None and mps.thread_percentage:
                configured_threads[target.position] = mps.thread_percentage
    if len(set(configured_threads.values())) > 1:
        shown = ", ".join(f"devices[{p}]: {v}" for p, v in sorted(configured_threads.items()))
        for position in configured_threads:
            errors.add(position, "sharing.mpsConfig.defaultActiveThreadPercentage",
                       f"one MPS daemon serves the claim's MPS devices, so they must agree on "
                       f"the thread percentage ({shown})")
    if errors.items:
        fields = ", ".join(e["field"] for e in errors.items)
        raise InvalidRequest(f"sharing cannot be honoured: {errors.items[0]['reason']} "
                             f"({fields})", errors.items)
    mps_devices = [d for d in devices if d.strategy == "MPS"]
    daemon = None
    if mps_devices:
        if configured_threads:
            threads: int | None = next(iter(configured_threads.values()))
        else:
            # Implicit (share-proportional) percentages: the daemon-wide default must not
            # give any share more than its proportion, so the smallest wins.
            implicit = [d.thread_percentage for d in mps_devices if d.thread_percentage]
            threads = min(implicit) if implicit else None
        mps_devices = [DevicePlan(**{**d.__dict__, "thread_percentage": threads})
                       for d in mps_devices]
        by_position = {d.position: d for d in mps_devices}
        devices = [by_position.get(d.position, d) for d in devices]
        daemon = DaemonIntent(
            devices=tuple(sorted(d.uuid for d in mps_devices)), thread_percentage=threads,
            pinned_limits_mib=tuple(sorted((d.uuid, d.pinned_mib) for d in mps_devices
                                           if d.pinned_mib is not None)))
    return SharingPlan(devices=tuple(devices), daemon=daemon)


def _mps(target: Target) -> bool:
    """Whether the device runs under the claim's MPS daemon: asked for, or a partial share."""
    if target.sharing is not None:
        return target.sharing.strategy == "MPS"
    return target.memory_share_mib is not None and target.kind == "gpu" and \
        target.memory_share_mib < shareable_mib(target.memory_mib)


def _device_plan(target: Target, mps_uuids: Sequence[str], errors: _Errors, *,
                 dynamic_mig: bool) -> DevicePlan | None:
    """One device's plan (None when it shares nothing); problems go to ``errors``."""
    sharing, share, at = target.sharing, target.memory_share_mib, target.position
    if sharing is None and share is None:
        return None
    before = len(errors.items)
    if target.admin_access:
        errors.add(at, "sharing" if sharing is not None else "capacity",
                   "an admin-access device is held for monitoring; it shares nothing")
    shareable = shareable_mib(target.memory_mib) if target.kind == "gpu" else None
    share_mib: int | None = None
    if share is not None:
        if target.kind != "gpu" or target.mig_enabled:
            errors.add(at, "capacity.memory", "memory shares are of full GPUs with MIG off; "
                       "this device is a MIG device" if target.kind != "gpu" else
                       "memory shares are of full GPUs with MIG off; this GPU has MIG on")
        elif dynamic_mig:
            errors.add(at, "capacity.memory", "memory shares are enforced with MPS, which "
                       "--dynamic-mig excludes")
        elif shareable is not None and share > shareable:
            errors.add(at, "capacity.memory", f"{share} MiB is more than the GPU's shareable "
                       f"memory ({shareable} MiB: {target.memory_mib} MiB rounded down to "
                       "whole GiB)")
        elif shareable is not None and share < shareable:
            share_mib = share
    strategy: Strategy | None = sharing.strategy if sharing is not None else \
        "MPS" if share_mib is not None else None
    timeslice = interval = None
    exclusive_process = False
    threads = pinned = None
    if strategy == "TimeSlicing":
        assert sharing is not None
        if target.kind != "gpu":
            errors.add(at, "sharing.strategy", "time-slicing applies to full GPUs only (the "
                       "interval is GPU-wide); this is a MIG device")
        elif share_mib is not None:
            errors.add(at, "sharing.strategy", "time-slicing sets a GPU-wide interval, so it "
                       "cannot apply to a share of a GPU others share too")
        interval = sharing.interval or "Default"
        timeslice = TIMESLICE_VALUES[interval]
    elif strategy == "MPS":
        if dynamic_mig:
            errors.add(at, "sharing.strategy", "MPS is not supported with --dynamic-mig (as "
                       "in NVIDIA's driver)")
        mps = sharing.mps if sharing is not None and sharing.mps is not None else MpsConfig()
        limit_of = share_mib if share_mib is not None else target.memory_mib
        pinned = mps.pinned_mib
        if pinned is not None and pinned > limit_of:
            errors.add(at, "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
                       _above(pinned, limit_of, share_mib is not None))
        for key, value in mps.per_device_mib:
            named = _per_device_key(key, mps_uuids)
            where = f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}"
            if named is None:
                errors.add(at, where, f"{key!r} is neither the UUID of one of the claim's MPS "
                           f"devices nor an index below {len(mps_uuids)} into their sorted "
                           "UUIDs")
            elif named == target.uuid:
                if value > limit_of:
                    errors.add(at, where, _above(value, limit_of, share_mib is not None))
                pinned = value
        if pinned is None and share_mib is not None:
            pinned = share_mib
        threads = mps.thread_percentage
        if threads is None and share_mib is not None and shareable:
            threads = implicit_threads(share_mib, shareable)
        exclusive_process = target.kind == "gpu" and share_mib is None
    if len(errors.items) > before or (strategy is None and share_mib is None):
        return None  # refused (the errors say why), or the whole GPU: nothing shared
    return DevicePlan(position=at, uuid=target.uuid, gpu=target.gpu, strategy=strategy,
                      timeslice=timeslice, interval=interval,
                      exclusive_process=exclusive_process, thread_percentage=threads,
                      pinned_mib=pinned, share_mib=share_mib,
                      shareable_mib=shareable if share_mib is not None else None)


def _above(value: int, limit: int, share: bool) -> str:
    return (f"{value} MiB is above the device's {'share' if share else 'memory'} "
            f"({limit} MiB)")


def _per_device_key(key: str, uuids: Sequence[str]) -> str | None:
    """The UUID a per-device limit's key names: a UUID of the claim's, or an index into the
    claim's sorted MPS device UUIDs."""
    if key in uuids:
        return key
    if key.isascii() and key.isdigit() and int(key) < len(uuids) and (key == "0"
                                                                      or key[0] != "0"):
        return uuids[int(key)]
    return None
