"""The agent's one exception hierarchy. The API maps each class to an HTTP problem in one place
(``agent/api/problems.py``); code below the API raises these and never builds responses."""

from __future__ import annotations

import errno
from typing import Any


class AgentError(Exception):
    """Base of every error the agent reports on purpose."""

    #: HTTP status the API answers with.
    status: int = 500
    #: Stable machine-readable problem type (the last part of the problem ``type`` URI).
    type_name: str = "internal-error"
    title: str = "Internal error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra: dict[str, Any] = extra


class NotFound(AgentError):
    status = 404
    type_name = "not-found"
    title = "Not found"


class InvalidRequest(AgentError):
    """The request is malformed; ``errors`` lists the offending fields and why."""

    status = 422
    type_name = "invalid-request"
    title = "Invalid request"

    def __init__(self, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail, errors=errors or [])


class Unauthorized(AgentError):
    status = 401
    type_name = "unauthorized"
    title = "Unauthorized"


class Forbidden(AgentError):
    status = 403
    type_name = "forbidden"
    title = "Forbidden"


class Conflict(AgentError):
    status = 409
    type_name = "conflict"
    title = "Conflict"


class NotReady(AgentError):
    """The agent is up but cannot answer yet (NVML not initialised, recovery running);
    ``retry_after_s`` is when to try again."""

    status = 503
    type_name = "not-ready"
    title = "Not ready"

    def __init__(self, detail: str, *, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class StateLocked(AgentError):
    """Another agent process holds the state directory."""

    status = 409
    type_name = "state-locked"
    title = "State directory locked"

    def __init__(self, *, path: str, holder_pid: str) -> None:
        super().__init__(
            f"another gpu-agent (pid {holder_pid}) holds {path}; one agent per state directory",
            path=path,
            holder_pid=holder_pid,
        )


class NvmlError(AgentError):
    """An NVML call failed. ``code`` is the NVML return code, ``function`` the NVML function."""

    status = 502
    type_name = "nvml-error"
    title = "NVML call failed"

    def __init__(self, *, function: str, code: int, name: str, gpu: str | None = None) -> None:
        where = f" on {gpu}" if gpu else ""
        super().__init__(f"{function}{where} failed: {name} ({code})", function=function,
                         code=code, nvml_error=name, gpu=gpu)
        self.function = function
        self.code = code
        self.name = name
        self.gpu = gpu


class GpuLost(NvmlError):
    """The GPU answered ``NVML_ERROR_GPU_IS_LOST``: it has fallen off the bus."""

    status = 503
    type_name = "gpu-lost"
    title = "GPU lost"


class BadRequest(AgentError):
    """The body is not what the endpoint reads at all (not JSON, wrong content type)."""

    status = 400
    type_name = "bad-request"
    title = "Bad request"


class GeometryNotPlaceable(AgentError):
    """A desired MIG geometry cannot be placed on the GPU; ``detail`` says why in words."""

    status = 422
    type_name = "geometry-not-placeable"
    title = "MIG geometry cannot be placed"


class DeviceBusy(Conflict):
    """A device another claim holds, or one being drained or unhealthy."""

    type_name = "device-busy"
    title = "Device busy"


class DeviceUnavailable(Conflict):
    """A GPU or MIG device that cannot be handed out: lost, unhealthy (an XID), quarantined."""

    type_name = "device-unavailable"
    title = "Device unavailable"


class ClaimUnprepared(Conflict):
    """A prepare for a claim UID that was unprepared moments ago: a stale retry, refused so it
    cannot resurrect the claim (Kubernetes never reuses a claim UID)."""

    type_name = "claim-unprepared"
    title = "Claim was unprepared"


class CheckpointUnusable(AgentError):
    """The claims checkpoint was corrupt and kept aside; claims stay frozen until an operator
    acts."""

    status = 503
    type_name = "checkpoint-corrupt"
    title = "Claims checkpoint unusable"


class StorageUnavailable(AgentError, OSError):
    """A durable write to the state directory failed (disk full, read-only, I/O error): the
    change was not made and nothing was acknowledged. Still an :class:`OSError` (same
    ``errno``) for callers that handle those."""

    status = 507
    type_name = "insufficient-storage"
    title = "State directory not writable"

    def __init__(self, path: str, err: OSError) -> None:
        name = errno.errorcode.get(err.errno or 0, "EIO")
        AgentError.__init__(
            self, f"cannot write {path}: {err.strerror or err} ({name}); the change was not "
            "made. Free space or fix the state directory, then retry.", path=path,
            errno=name)
        self.errno = err.errno
        self.strerror = err.strerror
