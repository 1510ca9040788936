"""XID critical errors from NVML's event set, on a thread of its own.

``nvmlEventSetWait_v2`` blocks, so the thread waits in short slices (``wait_ms``) and checks
its stop flag between them: shutdown takes at most one slice. The slice is short (100 ms): an
idle wait sleeps in the driver, so ten wake-ups a second cost nothing measurable, while every
stop of the agent waits for the slice in progress. The event names the GPU by
handle, not UUID (a lost GPU no longer answers ``nvmlDeviceGetUUID``), so handles are mapped
to UUIDs when they are registered. Right after each XID the watcher reads the GPU's recovery
action (:mod:`agent.gpu.recovery`) on the same thread, so the event carries what the driver
says the GPU now needs.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agent.errors import NvmlError
from agent.gpu.recovery import RecoveryActionReader
from agent.gpu.session import NvmlSession, nvml_error_name
from agent.gpu.types import GpuStatic

log = logging.getLogger("agent.gpu.xid")

# NVML's "no GPU/compute instance" in event records.
_NO_INSTANCE = 0xFFFFFFFF
# After an unexpected wait error, pause this long so a broken event set cannot spin a core.
_ERROR_PAUSE_S = 1.0


@dataclass(frozen=True)
class XidEvent:
    """One XID on a GPU; ``gi_id``/``ci_id`` name the MIG instance it came from, if any;
    ``recovery_action`` is NVML's field 230 read right after it (the GPU's, whatever
    instance the XID came from), None where the driver does not report it or the read
    failed. It is the GPU's state, not the event's: an application XID after a fatal one
    reads the fatal one's action until the GPU is reset."""

    gpu_uuid: str
    xid: int
    gi_id: int | None = None
    ci_id: int | None = None
    recovery_action: int | None = None


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class XidWatcher:
    """Registers every GPU for ``nvmlEventTypeXidCriticalError`` and calls ``on_xid`` (from
    its thread) for each event. ``on_error`` receives NVML errors other than the wait's
    routine ``TIMEOUT``, which is not an error and is not counted."""

    def __init__(self, session: NvmlSession, on_xid: Callable[[XidEvent], None], *,
                 on_error: Callable[[NvmlError], None] | None = None,
                 wait_ms: int = 100) -> None:
        self._session = session
        self._on_xid = on_xid
        self._on_error = on_error
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recovery = RecoveryActionReader(session)
        self.registered: tuple[str, ...] = ()
        #: Set once registration ended (``registered`` is then final, empty or not).
        self.registration_done = threading.Event()

    def start(self, gpus: Iterable[GpuStatic]) -> None:
        """Start watching these GPUs (registration happens on the watcher thread)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(tuple(gpus),),
                                        name="xid-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop and wait for the thread (at most one wait slice, plus a margin)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self._wait_ms / 1000 + 2)
            self._thread = None

    # -- the thread ------------------------------------------------------------------------

    def _run(self, gpus: tuple[GpuStatic, ...]) -> None:
        try:
            event_set = self._session.call("nvmlEventSetCreate")
        except NvmlError as err:
            log.error("xid watcher cannot create an event set", extra={"error": err.detail})
            self.registration_done.set()
            return
        try:
            by_handle = self._register(event_set, gpus)
            self.registered = tuple(by_handle.values())
            self.registration_done.set()
            if not by_handle:
                log.warning("no GPU accepts XID event registration; XIDs are not watched")
                return
            log.info("watching xid events", extra={"gpus": len(by_handle)})
            while not self._stop.is_set():
                self._wait_once(event_set, by_handle)
        finally:
            try:
                self._session.call("nvmlEventSetFree", event_set)
            except NvmlError as err:
                log.warning("xid event set free failed", extra={"error": err.detail})

    def _register(self, event_set: Any, gpus: tuple[GpuStatic, ...]) -> dict[int, str]:
        nvml = self._session.nvml
        found: dict[int, str] = {}
        for gpu in gpus:
            if gpu.minor < 0:
                continue  # lost since start-up: no handle to register
            try:
                handle = self._session.call("nvmlDeviceGetHandleByUUID", gpu.uuid, gpu=gpu.uuid)
                self._session.call("nvmlDeviceRegisterEvents", handle,
                                   nvml.nvmlEventTypeXidCriticalError, event_set, gpu=gpu.uuid)
            except NvmlError as err:
                log.warning("xid events not available", extra={"gpu": gpu.uuid,
                                                               "error": err.detail})
                continue
            found[_address(handle)] = gpu.uuid
        return found

    def _wait_once(self, event_set: Any, by_handle: dict[int, str]) -> None:
        nvml = self._session.nvml
        try:
            # Called directly, not through session.call: TIMEOUT is the normal answer of an
            # idle wait every slice and must not count as an NVML error.
            data = nvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
        except nvml.NVMLError as err:
            code = int(err.value)
            if code == nvml.NVML_ERROR_TIMEOUT:
                return
            error = NvmlError(function="nvmlEventSetWait_v2", code=code,
                              name=nvml_error_name(nvml, code))
            if self._on_error is not None:
                self._on_error(error)
            log.warning("xid event wait failed", extra={"error": error.detail})
            self._stop.wait(_ERROR_PAUSE_S)
            return
        if not int(data.eventType) & int(nvml.nvmlEventTypeXidCriticalError):
            return
        uuid = by_handle.get(_address(data.device))
        if uuid is None:
            log.warning("xid event for an unknown device", extra={"xid": int(data.eventData)})
            return
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        event = XidEvent(gpu_uuid=uuid, xid=int(data.eventData),
                         gi_id=None if gi == _NO_INSTANCE else gi,
                         ci_id=None if ci == _NO_INSTANCE else ci,
                         recovery_action=self._recovery.read(uuid, data.device))
        try:
            self._on_xid(event)
        except Exception:
            log.exception("xid handler failed", extra={"gpu": uuid, "xid": event.xid})
