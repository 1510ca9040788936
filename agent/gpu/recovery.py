"""NVML's recovery action for a GPU: field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (230) of
``nvmlDeviceGetFieldValues``, the driver's word on what it takes to make the GPU usable again
(0 none, 1 GPU reset, 2 node reboot, 3 drain peer-to-peer, 4 drain and reset; newer drivers
add more, passed on as they are). It replaces the deprecated fields 226/227.

Recent data-center drivers report it; older ones answer NOT_SUPPORTED in the field, and then
the XID table decides (``reference/health.md``). So every read answers None rather than
fail: for NOT_SUPPORTED, and for any NVML error (a lost GPU answers GPU_IS_LOST). Reads block
in the driver: call them from a worker thread (``NvmlSession.read``) or the XID watcher's
own thread, never on the event loop.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from agent.errors import NvmlError
from agent.gpu.session import NvmlSession, nvml_error_name
from agent.gpu.telemetry import field_value

log = logging.getLogger("agent.gpu.recovery")

#: ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, by number: pynvml releases before the field do
#: not name it, and the driver answers NOT_SUPPORTED for it anyway.
RECOVERY_ACTION_FIELD = 230


@dataclass(frozen=True)
class RecoveryRead:
    """One read: the action, or None and why (the NVML error's name)."""

    action: int | None
    unknown_because: str | None = None


def read(session: NvmlSession, gpu_uuid: str, handle: Any = None) -> RecoveryRead:
    """Read the GPU's recovery action once (``handle``: its device handle, if at hand)."""
    nvml = session.nvml
    try:
        if handle is None:
            handle = session.gpu_handle(gpu_uuid)
        found = session.call("nvmlDeviceGetFieldValues", handle, [RECOVERY_ACTION_FIELD],
                             gpu=gpu_uuid)
    except NvmlError as err:
        return RecoveryRead(None, err.name)
    value = found[0]
    status = int(value.nvmlReturn)
    if status != int(nvml.NVML_SUCCESS):
        return RecoveryRead(None, nvml_error_name(nvml, status))
    return RecoveryRead(int(field_value(nvml, value)))


def read_recovery_action(session: NvmlSession, gpu_uuid: str) -> int | None:
    """The GPU's recovery action now, None where it is not known (logged): for start-up,
    before any XID arrives (a GPU that needed a reset before the agent started still does)."""
    result = read(session, gpu_uuid)
    if result.action is None:
        _log_unknown(gpu_uuid, result.unknown_because)
    return result.action


class RecoveryActionReader:
    """Reads for a caller that reads again and again (the XID watcher): why a GPU's action
    is unknown is logged the first time only, so an XID storm on an older driver logs once."""

    def __init__(self, session: NvmlSession) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def read(self, gpu_uuid: str, handle: Any = None) -> int | None:
        """The GPU's recovery action now (``handle``: its device handle, if at hand)."""
        result = read(self._session, gpu_uuid, handle)
        if result.action is None:
            with self._lock:
                first = gpu_uuid not in self._logged
                self._logged.add(gpu_uuid)
            if first:
                _log_unknown(gpu_uuid, result.unknown_because)
        return result.action


def _log_unknown(gpu_uuid: str, because: str | None) -> None:
    if because == "NVML_ERROR_NOT_SUPPORTED":
        log.info("driver reports no recovery action; XIDs are classified by the XID table",
                 extra={"gpu": gpu_uuid})
    else:
        log.warning("recovery action not read; XIDs are classified by the XID table",
                    extra={"gpu": gpu_uuid, "error": because})
