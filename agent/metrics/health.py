"""GPU health the agent adds to what NVML answers: critical XIDs, and GPUs that stopped
answering (``GPU_IS_LOST``), shown in ``/v1/gpus``, ``/v1/events`` and ``gpu_agent_gpu_healthy``.

Recovery rule: an XID mark stays until the GPU is reset, because only a reset makes such a
GPU trustworthy again, and NVML does not report a reset. It is cleared by an operator's
``gpu-agent admin clear-xid N`` (``POST /v1/admin/gpus/{gpu}/clear-health``) after resetting
the GPU, and by the simulator's own reset and driver reload, which the agent sees. The marks
are not kept across a restart of the agent: the next start reads the hardware afresh, and a
GPU still lost is marked again from NVML's answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.events import EventLog, Severity
from agent.gpu.types import GpuStatic
from agent.gpu.xid import XidEvent
from agent.metrics.agent import AgentMetrics

log = logging.getLogger("agent.metrics.health")

#: XIDs after which the GPU needs a reset (or a reboot) before it can be trusted again: the
#: "reset GPU" / "reboot" / "drain" buckets of NVIDIA's XID catalog for data-center GPUs.
#: Other XIDs (13, 31, 43, 45, 68, 109 ...) are application faults: counted, not marking.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154})

#: ``err_msg`` label values of DCGM_FI_DEV_XID_ERRORS (NVIDIA's XID descriptions).
XID_MESSAGES: dict[int, str] = {
    0: "No Error",
    8: "GPU stopped processing",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    46: "GPU stopped processing",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    69: "Graphics Engine class error",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
    121: "C2C Link corrected error",
    140: "Unrecovered ECC Error",
    143: "GPU Initialization Failure",
    154: "GPU Recovery Action Changed",
}
# The same XID on the same GPU within this many seconds is counted but not logged again as
# an event, so a storm cannot flush transitions and claims out of the bounded event ring.
COALESCE_S = 60.0


def xid_message(xid: int) -> str:
    return XID_MESSAGES.get(xid, "Unknown Error")


@dataclass(frozen=True)
class LastXid:
    xid: int
    message: str
    time: float


class GpuHealth:
    """Thread-safe: the XID thread and the collector write, request handlers read.

    ``lost_reason`` is the NVML session's record of GPUs that answered ``GPU_IS_LOST``.
    """

    def __init__(self, *, events: EventLog, metrics: AgentMetrics,
                 lost_reason: Callable[[str], str | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._events = events
        self._metrics = metrics
        self._lost_reason = lost_reason
        self._clock = clock
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}
        self._marks: dict[str, list[str]] = {}
        self._last: dict[str, LastXid] = {}
        self._seen: dict[tuple[str, int], float] = {}
        self._unhealthy: set[str] = set()

    def track(self, gpus: Iterable[GpuStatic]) -> None:
        """The GPUs to report: each gets its ``gpu_agent_gpu_healthy`` series now."""
        with self._lock:
            for gpu in gpus:
                self._index[gpu.uuid] = gpu.index
        self.check()

    # -- reading ---------------------------------------------------------------------------

    def xid_reasons(self, gpu_uuid: str) -> tuple[str, ...]:
        """Why XIDs marked this GPU unhealthy (empty if they did not)."""
        with self._lock:
            return tuple(self._marks.get(gpu_uuid, ()))

    def healthy(self, gpu_uuid: str) -> bool:
        return not self.xid_reasons(gpu_uuid) and self._lost_reason(gpu_uuid) is None

    def last_xid(self, gpu_uuid: str) -> LastXid | None:
        with self._lock:
            return self._last.get(gpu_uuid)

    # -- writing ---------------------------------------------------------------------------

    def clear(self, gpu_uuid: str, *, why: str) -> list[str]:
        """Forget the GPU's XID marks (after a reset, or an operator's word that it was
        reset): the reasons cleared, and a ``gpu.health_cleared`` event when there were
        any. The last XID stays on record; the next critical XID marks the GPU again."""
        with self._lock:
            cleared = self._marks.pop(gpu_uuid, [])
            self._seen = {k: v for k, v in self._seen.items() if k[0] != gpu_uuid}
            index = self._index.get(gpu_uuid)
        if cleared:
            self._events.append("gpu.health_cleared",
                                f"GPU {index} ({gpu_uuid}): {'; '.join(cleared)} cleared "
                                f"({why})", gpu=gpu_uuid,
                                details={"cleared": cleared, "why": why})
        self.check()
        return cleared

    def record_xid(self, event: XidEvent) -> None:
        """Count an XID, remember it as the GPU's last, and mark the GPU if it is critical."""
        uuid, xid = event.gpu_uuid, event.xid
        message = xid_message(xid)
        now = self._clock()
        self._metrics.xid_errors.labels(str(xid)).inc()
        critical = xid in CRITICAL_XIDS
        reason = f"XID {xid}: {message}"
        with self._lock:
            self._last[uuid] = LastXid(xid, message, time.time())
            seen = self._seen.get((uuid, xid))
            self._seen[(uuid, xid)] = now
            newly_marked = critical and reason not in self._marks.get(uuid, [])
            if newly_marked:
                self._marks.setdefault(uuid, []).append(reason)
        if newly_marked or seen is None or now - seen >= COALESCE_S:
            details: dict[str, object] = {"xid": xid, "message": message, "critical": critical}
            if event.gi_id is not None:
                details.update(gpu_instance_id=event.gi_id, compute_instance_id=event.ci_id)
            self._events.append("gpu.xid", f"XID {xid} on {uuid}: {message}",
                                severity=Severity.ERROR if critical else Severity.WARNING,
                                gpu=uuid, details=details)
        if newly_marked:
            self.check()

    def check(self) -> None:
        """Bring ``gpu_agent_gpu_healthy`` up to date; an event when a GPU turns unhealthy."""
        with self._lock:
            tracked = list(self._index.items())
        for uuid, index in tracked:
            healthy = self.healthy(uuid)
            self._metrics.gpu_healthy.labels(str(index), uuid).set(1 if healthy else 0)
            with self._lock:
                turned = not healthy and uuid not in self._unhealthy
                if turned:
                    self._unhealthy.add(uuid)
                elif healthy:
                    self._unhealthy.discard(uuid)  # a later mark is reported again
            if turned:
                reasons = list(self.xid_reasons(uuid))
                lost = self._lost_reason(uuid)
                if lost is not None:
                    reasons.insert(0, f"GPU is lost: {lost}")
                self._events.append("gpu.unhealthy", f"GPU {index} ({uuid}) is unhealthy: "
                                    + "; ".join(reasons), severity=Severity.ERROR, gpu=uuid,
                                    details={"reasons": reasons})
