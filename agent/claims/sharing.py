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
  MIG devices (compute mode untouched); as in NVIDIA's driver, each MPS config gets a control
  daemon of its own for the devices it applies to (:func:`config_groups`), with its own
  directories and limits, so two configs of one claim are isolated from each other;
- a pinned memory limit is whole MiB, rounded down, at least 1 (:func:`pinned_limit_mib`, as
  NVIDIA's driver converts it) and at most the device's memory (a share's: the share); a
  per-device key is a UUID or an index into the config's sorted device UUIDs, read as
  NVIDIA's driver reads it (:func:`per_device_index`);
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
from agent.quantity import QuantityError, kubernetes_value, quantity_of

Strategy = Literal["TimeSlicing", "MPS"]
Interval = Literal["Default", "Short", "Medium", "Long"]
#: ``nvidia-smi compute-policy --set-timeslice`` values (NVIDIA's DRA driver's mapping).
TIMESLICE_VALUES: Mapping[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
#: The counted capacity a memory share takes in the ledger.
MEMORY_MIB = "memory_mib"


@dataclass(frozen=True)
class MpsConfig:
    """``mpsConfig``: limits in MiB; ``per_device_mib`` keys are UUIDs or indices into the
    sorted UUIDs of the devices the config applies to, as NVIDIA's driver reads them."""

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
    """One MPS control daemon of the claim (one per MPS config): its devices (UUIDs,
    sorted), limits, and the claim's device positions it serves."""

    devices: tuple[str, ...]
    thread_percentage: int | None
    pinned_limits_mib: tuple[tuple[str, int], ...] = ()
    positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class SharingPlan:
    devices: tuple[DevicePlan, ...] = ()
    daemons: tuple[DaemonIntent, ...] = ()
    """The claim's MPS daemons, in the order of the first device each serves."""

    @property
    def daemon(self) -> DaemonIntent | None:
        """The first daemon (the only one, when the claim has one MPS config)."""
        return self.daemons[0] if self.daemons else None

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


def daemon_root(mps_root: Path, uid: str, index: int = 0) -> Path:
    """The directory of the claim's ``index``-th MPS daemon: ``<short id>`` for the first
    (the only one of a claim with one MPS config), ``<short id>-<index>`` for the others."""
    return mps_root / (short_id(uid) if index == 0 else f"{short_id(uid)}-{index}")


#: NVIDIA's driver sends pinned limits as whole MiB (``set_default_device_pinned_mem_limit
#: <uuid> <N>M``) and refuses N = 0.
_MIB = 2**20


def pinned_limit_mib(value: object) -> int:
    """An MPS pinned memory limit in whole MiB as NVIDIA's driver computes it
    (``api/nvidia.com/resource/v1beta1/sharing.go``, ``limit.Megabyte``): the quantity's
    ``Value()`` in bytes (rounded up), divided by 2^20 and rounded down, so ``1G`` is 953 MiB
    and ``10M`` 9. ValueError (NVIDIA's "value set too low") for a limit below 1 MiB, zero and
    negatives included, and for anything that is not a Kubernetes quantity."""
    try:
        quantity = quantity_of(value)
    except QuantityError as err:
        raise ValueError(f"not a memory quantity: {err}") from None
    mib = kubernetes_value(quantity) // _MIB if quantity > 0 else 0
    if mib < 1:
        shown = value if isinstance(value, int) else repr(value)[:40]
        raise ValueError(f"invalid limit: value set too low: {shown} is below 1 MiB (NVIDIA's "
                         "driver gives MPS a pinned limit in whole MiB, rounded down, and "
                         "refuses 0)")
    return mib


def per_device_index(key: str) -> int | None:
    """A per-device key as an index, as NVIDIA's driver reads one that is not a UUID of the
    config (Go's ``strconv.Atoi``): optional ``+``/``-``, ASCII digits, leading zeros
    allowed (``00`` is 0), within int64; None when it is no integer."""
    body = key[1:] if key[:1] in ("+", "-") else key
    if not body or not body.isascii() or not body.isdigit():
        return None
    index = int(key)
    return index if -2**63 <= index < 2**63 else None


def config_groups(targets: Sequence[Target]) -> list[list[Target]]:
    """The claim's MPS devices by the config that applies to them, one daemon each, in the
    order of each group's first device: the devices of one kind (full GPU or MIG: NVIDIA's
    ``GpuConfig`` and ``MigDeviceConfig`` are separate configs) with an equal ``sharing``,
    and the partial shares without a config (the default config) together."""
    groups: dict[tuple[object, ...], list[Target]] = {}
    for target in targets:
        if _mps(target):
            key: tuple[object, ...] = ("config", target.kind, target.sharing) \
                if target.sharing is not None else ("share",)
            groups.setdefault(key, []).append(target)
    return list(groups.values())


def implicit_threads(share_mib: int, shareable: int) -> int:
    """The thread percentage a share gets unless configured: proportional, at least 1."""
    return max(1, 100 * share_mib // shareable) if shareable > 0 else 1


def plan(targets: Sequence[Target], *, dynamic_mig: bool = False) -> SharingPlan:
    """The claim's sharing plan, or :class:`InvalidRequest` listing every offending field."""
    errors = _Errors()
    groups = config_groups(targets)
    group_of = {t.position: i for i, group in enumerate(groups) for t in group}
    uuids_of = [sorted(t.uuid for t in group) for group in groups]
    devices: list[DevicePlan] = []
    for target in targets:
        index = group_of.get(target.position)
        device = _device_plan(target, uuids_of[index] if index is not None else [], errors,
                              dynamic_mig=dynamic_mig)
        if device is not None:
            devices.append(device)
    if errors.items:
        fields = ", ".join(e["field"] for e in errors.items)
        raise InvalidRequest(f"sharing cannot be honoured: {errors.items[0]['reason']} "
                             f"({fields})", errors.items)
    by_position = {d.position: d for d in devices}
    daemons = []
    for group in groups:
        served = [by_position[t.position] for t in group if t.position in by_position
                  and by_position[t.position].strategy == "MPS"]
        if not served:
            continue
        config = group[0].sharing.mps if group[0].sharing is not None else None
        if config is not None and config.thread_percentage:
            threads: int | None = config.thread_percentage
        else:
            # Implicit (share-proportional) percentages: the daemon-wide default must not
            # give any share more than its proportion, so the smallest wins.
            implicit = [d.thread_percentage for d in served if d.thread_percentage]
            threads = min(implicit) if implicit else None
        for d in served:
            by_position[d.position] = DevicePlan(**{**d.__dict__, "thread_percentage": threads})
        daemons.append(DaemonIntent(
            devices=tuple(sorted(d.uuid for d in served)), thread_percentage=threads,
            pinned_limits_mib=tuple(sorted((d.uuid, d.pinned_mib) for d in served
                                           if d.pinned_mib is not None)),
            positions=tuple(d.position for d in served)))
    return SharingPlan(devices=tuple(by_position[d.position] for d in devices),
                       daemons=tuple(daemons))


def _mps(target: Target) -> bool:
    """Whether the device runs under the claim's MPS daemon: asked for, or a partial share."""
    if target.sharing is not None:
        return target.sharing.strategy == "MPS"
    return target.memory_share_mib is not None and target.kind == "gpu" and \
        target.memory_share_mib < shareable_mib(target.memory_mib)


def _device_plan(target: Target, config_uuids: Sequence[str], errors: _Errors, *,
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
        named_by: dict[str, str] = {}
        for key, value in mps.per_device_mib:
            where = f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}"
            named, why = _per_device_key(key, config_uuids)
            if named is None:
                errors.add(at, where, why)
                continue
            if named in named_by:
                errors.add(at, where, f"{key!r} and {named_by[named]!r} both name {named}; "
                           "give each device one limit")
            named_by[named] = key
            if named == target.uuid:
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


def _per_device_key(key: str, uuids: Sequence[str]) -> tuple[str | None, str]:
    """(the UUID a per-device limit's key names, or None and why), as NVIDIA's driver reads
    the key (``uuidSet.Normalize``): a UUID of one of the config's devices, else an integer
    index into their sorted UUIDs."""
    if key in uuids:
        return key, ""
    index = per_device_index(key)
    if index is None:
        return None, (f"invalid device: {key[:100]!r} is neither the UUID of a device this MPS "
                      f"config applies to ({', '.join(uuids)}) nor an integer index into "
                      "their sorted UUIDs")
    if not 0 <= index < len(uuids):
        return None, (f"invalid device index: {index} (this MPS config applies to "
                      f"{len(uuids)} device{'s' if len(uuids) != 1 else ''}, indices 0 to "
                      f"{len(uuids) - 1} of their sorted UUIDs)")
    return uuids[index], ""
