"""GPU health the agent adds to what NVML answers, as :class:`~agent.health.taints.Fault`
values: every XID (application XIDs too: informational), GPUs that stopped answering
(``GPU_IS_LOST``), GPUs whose XID events cannot be registered, shown in ``/v1/gpus``,
``/v1/events``, ``gpu_agent_gpu_healthy`` and, through the ledger, as device taints.

Recovery rule: an XID fault stays until the GPU is reset, because only a reset makes such a
GPU trustworthy again, and NVML does not report a reset. It is cleared by an operator's
``gpu-agent admin clear-xid N`` (``POST /v1/admin/gpus/{gpu}/clear-health``) after resetting
the GPU, and by the simulator's own reset and driver reload, which the agent sees.

Durable (``<state>/health/faults.json``, ``agent/health/faults.py``): faults survive an agent
restart with their ``since`` (a taint's ``timeAdded`` does not move), a GPU still lost at the
next start included (NVML then names it by no UUID: it is known by its index); a reboot (a
new boot id) clears XIDs and lost marks. Unreadable health state fails closed: every GPU gets
a blocking ``quarantined`` fault naming the file until an operator clears it (``clear-xid``).
Writes run on a thread of their own, in order, so neither the XID thread nor the event loop
waits for an fsync; memory is the truth the taints follow at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from agent.durable import FileKind, Unreadable, dump_payload, read_durable, write_durable
from agent.errors import StorageUnavailable
from agent.events import EventLog, Severity
from agent.gpu.types import GpuStatic
from agent.gpu.xid import XidEvent
from agent.health.faults import GpuRecord, decode_state, encode_state, recovery_action
from agent.health.taints import Fault, FaultClass, fault_class
from agent.metrics.agent import AgentMetrics

log = logging.getLogger("agent.metrics.health")

STATE_KIND = FileKind("gpu-agent-health", 1)
UNMONITORED = ("XID events cannot be registered for this GPU: its faults would go unseen")

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


def xid_reason(xid: int, gi_id: int | None = None, ci_id: int | None = None) -> str:
    """The human sentence of an XID fault (its MIG instance, when NVML attributed it)."""
    where = "" if gi_id is None else f" (GPU instance {gi_id}" + (
        "" if ci_id is None else f", compute instance {ci_id}") + ")"
    return f"XID {xid}: {xid_message(xid)}{where}"


@dataclass(frozen=True)
class LastXid:
    xid: int
    message: str
    time: float


#: A stored fault's identity on its GPU: one fault per XID and MIG instance, one lost mark,
#: one fail-closed mark.
_Key = tuple[str, str | None, int | None, int | None]


def _key(fault: Fault) -> _Key:
    return (fault.kind, fault.value, fault.gi_id, fault.ci_id)


class GpuHealth:
    """Thread-safe: the XID thread and the collector write, request handlers read.

    ``lost_reason`` is the NVML session's record of GPUs that answered ``GPU_IS_LOST``;
    ``monitored`` the UUIDs whose XID events are registered (None until registration ended);
    ``state_path`` the durable health state (None: kept in memory only).
    """

    def __init__(self, *, events: EventLog, metrics: AgentMetrics,
                 lost_reason: Callable[[str], str | None],
                 state_path: Path | None = None, boot_id: str = "unknown",
                 monitored: Callable[[], Collection[str] | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._events = events
        self._metrics = metrics
        self._lost_reason = lost_reason
        self._monitored = monitored
        self._clock = clock
        self._wall = wall
        self._path = state_path
        self._boot_id = boot_id
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}
        self._minor: dict[str, int] = {}
        #: A GPU lost before this start (NVML gave no UUID) -> the UUID it was known by.
        self._alias: dict[str, str] = {}
        self._faults: dict[str, dict[_Key, Fault]] = {}
        self._unmonitored: dict[str, float] = {}
        self._last: dict[str, LastXid] = {}
        self._seen: dict[tuple[str, int], float] = {}
        self._unhealthy: set[str] = set()
        self._writer: ThreadPoolExecutor | None = None
        self._write_failed = False
        #: Why the health state file could not be read (every GPU fails closed), or None.
        self.problem: str | None = None
        self._records: dict[str, GpuRecord] = {}
        if state_path is not None:
            try:
                self._records = read_durable(
                    state_path, STATE_KIND,
                    lambda envelope: decode_state(envelope.payload, boot_id)) or {}
            except Unreadable as err:
                self.problem = str(err)
        for record in self._records.values():
            self._faults[record.uuid] = {_key(f): f for f in record.faults}
        self._unreadable_pending = self.problem is not None

    def track(self, gpus: Iterable[GpuStatic]) -> None:
        """The GPUs to report: each gets its ``gpu_agent_gpu_healthy`` series now. A GPU
        lost before this start is matched by index to the UUID it had; with unreadable health
        state every GPU gets its fail-closed fault (once)."""
        failed_closed: list[str] = []
        with self._lock:
            for gpu in gpus:
                self._index[gpu.uuid] = gpu.index
                self._minor[gpu.uuid] = gpu.minor
                if gpu.minor < 0:
                    known = next((r.uuid for r in self._records.values()
                                  if r.index == gpu.index and r.uuid not in self._index), None)
                    if known is not None:
                        self._alias[gpu.uuid] = known
                if self._unreadable_pending:
                    reason = (f"the health state was unreadable ({self.problem}); which GPUs "
                              "had faults can no longer be known: check the GPU, then clear "
                              "it with 'gpu-agent admin clear-xid'")
                    fault = Fault(kind="quarantined", reason=reason, since=self._wall())
                    self._faults.setdefault(self._real(gpu.uuid), {})[_key(fault)] = fault
                    failed_closed.append(gpu.uuid)
            self._unreadable_pending = False
        if failed_closed:
            self._events.append("gpu.health_state_unreadable",
                                f"{self.problem}; {len(failed_closed)} GPUs are held back "
                                "until an operator clears each", severity=Severity.ERROR,
                                details={"gpus": failed_closed})
            self._save()
        self.check()

    def _real(self, uuid: str) -> str:
        return self._alias.get(uuid, uuid)

    # -- reading ---------------------------------------------------------------------------

    def faults(self, gpu_uuid: str) -> tuple[Fault, ...]:
        """The GPU's faults now: its XIDs and fail-closed mark as stored, lost while NVML
        says so (since it was first seen lost, across restarts), unmonitored while its XID
        events are not registered."""
        lost = self._lost_reason(gpu_uuid)
        monitored = self._monitored()
        saved = False
        with self._lock:
            real = self._real(gpu_uuid)
            stored = self._faults.get(real, {})
            found = [f for k, f in stored.items() if k[0] != "gpu-lost"]
            if lost is not None:
                key: _Key = ("gpu-lost", None, None, None)
                held = stored.get(key)
                if held is None:
                    held = Fault(kind="gpu-lost", reason=f"GPU is lost: {lost}",
                                 since=self._wall())
                    self._faults.setdefault(real, {})[key] = held
                    saved = True
                found.insert(0, replace(held, reason=f"GPU is lost: {lost}"))
            elif monitored is not None and gpu_uuid not in monitored \
                    and self._minor.get(gpu_uuid, -1) >= 0:
                since = self._unmonitored.setdefault(gpu_uuid, self._wall())
                found.append(Fault(kind="unmonitored", reason=UNMONITORED, since=since))
        if saved:
            self._save()
        return tuple(found)

    def identity(self, gpu_uuid: str) -> tuple[str, int] | None:
        """(UUID, minor) a GPU lost before this start had, when the health state knows it."""
        with self._lock:
            real = self._alias.get(gpu_uuid)
            record = self._records.get(real) if real is not None else None
        return None if record is None else (record.uuid, record.minor)

    def xid_reasons(self, gpu_uuid: str) -> tuple[str, ...]:
        """Why XIDs keep new claims off this GPU or one of its MIG instances (empty if none
        does)."""
        return tuple(f.reason for f in self.faults(gpu_uuid)
                     if f.kind == "xid" and fault_class(f) is not FaultClass.INFORMATIONAL)

    def healthy(self, gpu_uuid: str) -> bool:
        """No fault of its own keeps new claims off it (informational ones do not count)."""
        return not any(fault_class(f) is not FaultClass.INFORMATIONAL
                       for f in self.faults(gpu_uuid))

    def last_xid(self, gpu_uuid: str) -> LastXid | None:
        with self._lock:
            return self._last.get(gpu_uuid)

    # -- writing ---------------------------------------------------------------------------

    def clear(self, gpu_uuid: str, *, why: str) -> list[str]:
        """Forget the GPU's stored faults (after a reset, or an operator's word that it was
        reset): XIDs, the lost mark's first sighting, the fail-closed mark. Returns the
        reasons cleared, with a ``gpu.health_cleared`` event when there were any. The last
        XID stays on record; the next XID makes a fault again."""
        with self._lock:
            cleared = [f.reason for k, f in self._faults.pop(self._real(gpu_uuid), {}).items()
                       if k[0] != "gpu-lost"]
            self._seen = {k: v for k, v in self._seen.items() if k[0] != gpu_uuid}
            index = self._index.get(gpu_uuid)
        self._save()
        if cleared:
            self._events.append("gpu.health_cleared",
                                f"GPU {index} ({gpu_uuid}): {'; '.join(cleared)} cleared "
                                f"({why})", gpu=gpu_uuid,
                                details={"cleared": cleared, "why": why})
        self.check()
        return cleared

    def record_xid(self, event: XidEvent) -> None:
        """Count an XID, remember it as the GPU's last, and keep it as a fault (the first
        sighting's time; the driver's latest recovery action)."""
        uuid, xid = event.gpu_uuid, event.xid
        message = xid_message(xid)
        now = self._clock()
        self._metrics.xid_errors.labels(str(xid)).inc()
        action = recovery_action(getattr(event, "recovery_action", None))
        fault = Fault(kind="xid", reason=xid_reason(xid, event.gi_id, event.ci_id),
                      since=self._wall(), value=str(xid), gi_id=event.gi_id,
                      ci_id=event.ci_id, recovery_action=action)
        blocking = fault_class(fault) is not FaultClass.INFORMATIONAL
        with self._lock:
            self._last[uuid] = LastXid(xid, message, time.time())
            seen = self._seen.get((uuid, xid))
            self._seen[(uuid, xid)] = now
            faults = self._faults.setdefault(self._real(uuid), {})
            held = faults.get(_key(fault))
            new = held is None
            if held is None:
                faults[_key(fault)] = fault
            elif held.recovery_action != action and action is not None:
                faults[_key(fault)] = replace(held, recovery_action=action)
            changed = faults[_key(fault)] != held
        if changed:
            self._save()
        if (new and blocking) or seen is None or now - seen >= COALESCE_S:
            details: dict[str, object] = {"xid": xid, "message": message, "critical": blocking}
            if event.gi_id is not None:
                details.update(gpu_instance_id=event.gi_id, compute_instance_id=event.ci_id)
            if action is not None:
                details["recovery_action"] = action.name.lower()
            self._events.append("gpu.xid", f"XID {xid} on {uuid}: {message}",
                                severity=Severity.ERROR if blocking else Severity.WARNING,
                                gpu=uuid, details=details)
        if new and blocking:
            self.check()

    def check(self) -> None:
        """Bring ``gpu_agent_gpu_healthy`` up to date (an event when a GPU turns unhealthy),
        and forget the lost mark of a GPU that answers again."""
        with self._lock:
            tracked = list(self._index.items())
        forgot = False
        for uuid, index in tracked:
            if self._lost_reason(uuid) is None:
                with self._lock:
                    stored = self._faults.get(self._real(uuid), {})
                    if stored.pop(("gpu-lost", None, None, None), None) is not None:
                        forgot = True
            healthy = self.healthy(uuid)
            self._metrics.gpu_healthy.labels(str(index), uuid).set(1 if healthy else 0)
            with self._lock:
                turned = not healthy and uuid not in self._unhealthy
                if turned:
                    self._unhealthy.add(uuid)
                elif healthy:
                    self._unhealthy.discard(uuid)  # a later fault is reported again
            if turned:
                reasons = [f.reason for f in self.faults(uuid)
                           if fault_class(f) is not FaultClass.INFORMATIONAL]
                self._events.append("gpu.unhealthy", f"GPU {index} ({uuid}) is unhealthy: "
                                    + "; ".join(reasons), severity=Severity.ERROR, gpu=uuid,
                                    details={"reasons": reasons})
        if forgot:
            self._save()

    # -- the state file --------------------------------------------------------------------

    def _save(self) -> None:
        """Write the state on the writer thread (in order; each write takes the latest)."""
        if self._path is None:
            return
        with self._lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="health-state")
            writer = self._writer
        writer.submit(self._write)

    def _write(self) -> None:
        assert self._path is not None
        with self._lock:
            records = []
            for uuid, faults in self._faults.items():
                durable = tuple(faults.values())
                if not durable:
                    continue
                known = self._records.get(uuid)
                index = self._index.get(uuid, known.index if known else -1)
                minor = self._minor.get(uuid, known.minor if known else -1)
                records.append(GpuRecord(uuid=uuid, index=index, minor=minor, faults=durable))
            payload = dump_payload(encode_state(self._boot_id, records))
        try:
            write_durable(self._path, STATE_KIND, payload)
        except (StorageUnavailable, OSError) as err:
            if not self._write_failed:
                self._write_failed = True
                self._events.append("gpu.health_state_unwritable",
                                    f"{self._path} cannot be written ({err}): GPU faults do "
                                    "not survive a restart until it can",
                                    severity=Severity.ERROR)
            log.error("health state not written", extra={"error": str(err)})
            return
        self._write_failed = False

    def close(self) -> None:
        """Wait for the writes in flight (the agent is stopping)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
