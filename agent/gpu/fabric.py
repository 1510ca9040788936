"""Reading a GPU's NVLink fabric (multi-node NVLink: cluster UUID, clique, registration state,
status and health mask) through NVML, for the inventory and topology discovery."""

from __future__ import annotations

import ctypes
from typing import Any

from agent.errors import NvmlError
from agent.gpu.session import NvmlSession, nvml_error_name
from agent.gpu.types import Fabric

# Answers meaning "this GPU has no fabric" rather than "something broke".
_ABSENT = frozenset({"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT",
                     "NVML_ERROR_NOT_FOUND"})
_STATE_NOT_SUPPORTED = 0
# NVML_GPU_FABRIC_HEALTH_MASK_*: (shift, width mask, the values that flag a problem), by the
# name the agent reports. The 2-bit fields say TRUE (1) when the condition holds; the 4-bit
# incorrect-configuration field names a cause from 2 up (1 is NONE).
_HEALTH_FIELDS: tuple[tuple[str, int, int, frozenset[int]], ...] = (
    ("degraded_bandwidth", 0, 0x3, frozenset({1})),
    ("route_recovery", 2, 0x3, frozenset({1})),
    ("route_unhealthy", 4, 0x3, frozenset({1})),
    ("access_timeout_recovery", 6, 0x3, frozenset({1})),
    ("incorrect_configuration", 8, 0xF, frozenset(range(2, 16))),
)


def health_flags(mask: int) -> tuple[str, ...]:
    """The problems a fabric health mask flags, in NVML's field order."""
    return tuple(name for name, shift, width, bad in _HEALTH_FIELDS
                 if (mask >> shift) & width in bad)


def _uuid_text(raw: bytes) -> str:
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def read_fabric(session: NvmlSession, handle: Any, uuid: str) -> Fabric | None:
    """The GPU's fabric (worker thread): the versioned call, or the older one where the driver
    lacks it; None where the GPU has none (NOT_SUPPORTED). Other NVML errors propagate."""
    nvml = session.nvml
    info: Any
    try:
        info = nvml.c_nvmlGpuFabricInfoV_t()
        session.call("nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info), gpu=uuid)
        mask: int | None = int(info.healthMask)
    except NvmlError as err:
        if err.name in _ABSENT:
            return None
        if err.name != "NVML_ERROR_FUNCTION_NOT_FOUND":
            raise
        info = nvml.c_nvmlGpuFabricInfo_t()  # drivers before the versioned call
        try:
            session.call("nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info), gpu=uuid)
        except NvmlError as older:
            if older.name in _ABSENT or older.name == "NVML_ERROR_FUNCTION_NOT_FOUND":
                return None
            raise
        mask = None
    if int(info.state) == _STATE_NOT_SUPPORTED:
        return None
    status = int(info.status)
    return Fabric(cluster_uuid=_uuid_text(bytes(info.clusterUuid)),
                  clique_id=int(info.cliqueId), state=int(info.state), status=status,
                  status_name="NVML_SUCCESS" if status == 0 else nvml_error_name(nvml, status),
                  health_mask=mask, health=health_flags(mask) if mask is not None else ())
