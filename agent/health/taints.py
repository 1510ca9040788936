"""A GPU's faults as Kubernetes device taints (pure: values in, values out).

One schema under the driver's domain, shaped like NVIDIA's DRA driver's
(``reference/health.md``) so a toleration ports by changing the domain:

| fault | key | value | effect |
|---|---|---|---|
| an XID | ``<driver>/xid`` | the XID in decimal | by recovery action, else the XID table |
| the GPU stopped answering (``GPU_IS_LOST``) | ``<driver>/gpu-lost`` | none | ``NoSchedule`` |
| XID events cannot be registered | ``<driver>/unmonitored`` | none | ``None`` |
| quarantined (MIG state unknown) | ``<driver>/quarantined`` | none | ``NoSchedule`` |
| an operator drained the GPU | ``<driver>/drain`` | the reason as a label value | ``NoSchedule`` |
| NVLink fabric not COMPLETED or failed | ``<driver>/fabric`` | state or status | ``NoSchedule`` |
| the fabric's health mask flags a problem | ``<driver>/fabric-health`` | the flag | ``None`` |

An XID's class: the driver's recovery action when it reports one (NVML field
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``: none is informational, a node or system reboot is
reboot class, every other action keeps new claims off); otherwise the XID table: application XIDs
are informational as NVIDIA's are, 79 (fallen off the bus) is reboot class, the rest keep new
claims off. A fabric fault (``agent/health/fabric.py``) keeps a GPU whose multi-node NVLink
registration is not done out of every claim (it cannot join a domain, and its clique is not
published); a flagged health mask on a registered fabric is informational. ``NoExecute`` is
opt-in (``no_execute``) and only for a lost GPU or a reboot-class fault: it makes Kubernetes
evict the pods using the device.

One taint per key, as NVIDIA's: of several XIDs the one that weighs most wins (effect first,
then the newest). A fault scoped to a MIG instance (GI, CI) taints that instance only; every
other fault taints the GPU and everything on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Literal

Effect = Literal["None", "NoSchedule", "NoExecute"]

#: XIDs of the application, not the GPU (NVIDIA's ``xidsToIgnore``): an informational taint.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: XIDs after which only a node reboot makes the GPU usable again (when the driver does not
#: report a recovery action).
REBOOT_XIDS = frozenset({79})
#: Effects by weight: the heavier taint of one key wins.
_WEIGHT: dict[str, int] = {"None": 0, "NoSchedule": 1, "NoExecute": 2}
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


class RecoveryAction(IntEnum):
    """NVML's ``nvmlDeviceGpuRecoveryAction_t`` (field 230)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


class FaultClass(Enum):
    INFORMATIONAL = "informational"  # effect None: counted, shown, never blocks
    BLOCKING = "blocking"  # NoSchedule: new claims stay off until the fault is cleared
    REBOOT = "reboot"  # NoSchedule, NoExecute with the opt-in flag


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a GPU, as the agent knows it.

    ``kind`` names the taint key's last part; ``value`` is the XID for ``xid`` faults;
    ``gi_id``/``ci_id`` scope an XID to one MIG instance where NVML attributed it;
    ``recovery_action`` is the driver's word (None where the driver does not report it);
    ``since`` is the wall-clock time the agent first saw it (the taint's ``timeAdded``);
    ``reason`` is the human sentence for ``/v1/gpus``, events and the CLI.
    """

    kind: Literal["xid", "gpu-lost", "unmonitored", "quarantined", "drain", "fabric",
                  "fabric-health"]
    reason: str
    since: float
    value: str | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    recovery_action: RecoveryAction | None = None


@dataclass(frozen=True)
class Taint:
    """A device taint: ``key``, ``value`` and ``effect`` as the ResourceSlice carries them,
    ``time_added`` in seconds since the epoch, and ``reason`` (not published) for humans."""

    key: str
    effect: Effect
    time_added: float
    reason: str
    value: str | None = None

    @property
    def blocking(self) -> bool:
        """Whether it keeps new claims off (every effect but ``None``)."""
        return self.effect != "None"


def fault_class(fault: Fault) -> FaultClass:
    """How much a fault weighs: by the driver's recovery action, else by the XID table."""
    if fault.kind in ("unmonitored", "fabric-health"):
        return FaultClass.INFORMATIONAL
    if fault.kind == "gpu-lost":
        return FaultClass.REBOOT
    if fault.kind != "xid":
        return FaultClass.BLOCKING
    if fault.recovery_action is not None:
        if fault.recovery_action is RecoveryAction.NONE:
            return FaultClass.INFORMATIONAL
        if fault.recovery_action in (RecoveryAction.NODE_REBOOT, RecoveryAction.SYSTEM_REBOOT):
            return FaultClass.REBOOT
        return FaultClass.BLOCKING
    xid = int(fault.value or 0)
    if xid in APPLICATION_XIDS:
        return FaultClass.INFORMATIONAL
    if xid in REBOOT_XIDS:
        return FaultClass.REBOOT
    return FaultClass.BLOCKING


def effect_of(fault: Fault, *, no_execute: bool) -> Effect:
    """The taint effect a fault gets (``NoExecute`` only when opted in, for reboot class)."""
    cls = fault_class(fault)
    if cls is FaultClass.INFORMATIONAL:
        return "None"
    if cls is FaultClass.REBOOT and no_execute:
        return "NoExecute"
    return "NoSchedule"


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value (at most 63 of ``[A-Za-z0-9._-]``, alphanumeric
    at both ends); empty if nothing of it is left."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-._")


def taint_of(fault: Fault, *, driver: str, no_execute: bool) -> Taint:
    """The taint one fault puts on the devices it reaches."""
    return Taint(key=f"{driver}/{fault.kind}", value=fault.value,
                 effect=effect_of(fault, no_execute=no_execute),
                 time_added=fault.since, reason=fault.reason)


def device_taints(faults: tuple[Fault, ...], *, driver: str, no_execute: bool,
                  instance: tuple[int, int | None] | None = None) -> tuple[Taint, ...]:
    """The taints of one device: the GPU itself (``instance`` None) or its MIG instance
    (``(gi_id, ci_id)``; a CI of None means the whole GPU instance). A fault scoped to a
    MIG instance reaches only that instance (a GI-wide fault every CI of it); the rest reach
    every device of the GPU. One taint per key: the heaviest effect, then the newest."""
    chosen: dict[str, Taint] = {}
    for fault in faults:
        if fault.gi_id is not None:
            if instance is None or instance[0] != fault.gi_id:
                continue
            if fault.ci_id is not None and instance[1] is not None and instance[1] != fault.ci_id:
                continue
        taint = taint_of(fault, driver=driver, no_execute=no_execute)
        held = chosen.get(taint.key)
        if held is None or (_WEIGHT[taint.effect], taint.time_added) > (
                _WEIGHT[held.effect], held.time_added):
            chosen[taint.key] = taint
    return tuple(sorted(chosen.values(), key=lambda t: t.key))


def blocking_reasons(taints: tuple[Taint, ...]) -> tuple[str, ...]:
    """Why a device may not be handed out: the reasons of its blocking taints."""
    return tuple(t.reason for t in taints if t.blocking)
