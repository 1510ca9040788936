"""The agent's one exception hierarchy.

Each class says what went wrong (``detail``, in words) and carries typed fields naming what
it is about (a GPU, a device, a claim, a path). None of them knows HTTP: ``agent/api/problems.py``
maps each class to a status, problem type and title in one table, and puts :meth:`fields` into
the problem body. Code below the API raises these and never builds responses.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from typing import Any


class AgentError(Exception):
    """Base of every error the agent reports on purpose."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def fields(self) -> dict[str, Any]:
        """What a problem body carries besides ``detail``: this error's typed fields, with None
        values and empty collections left out."""
        return {key: value for key, value in self._fields().items()
                if value is not None and value not in ([], {})}

    def _fields(self) -> dict[str, Any]:
        """Every field by its body name; subclasses extend their parent's."""
        return {}


class NotFound(AgentError):
    """The thing a request names does not exist on this node."""

    def __init__(self, detail: str, *, gpu: str | None = None, device: str | None = None,
                 claim: str | None = None, transition: str | None = None,
                 pid: int | None = None) -> None:
        super().__init__(detail)
        self.gpu = gpu
        self.device = device
        self.claim = claim
        self.transition = transition
        self.pid = pid

    def _fields(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "device": self.device, "claim": self.claim,
                "transition": self.transition, "pid": self.pid}


class InvalidRequest(AgentError):
    """The request is malformed; ``errors`` lists the offending fields and why (each a
    ``{"field": ..., "reason": ...}``)."""

    def __init__(self, detail: str, errors: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.errors: list[dict[str, Any]] = [dict(e) for e in errors or ()]

    def fields(self) -> dict[str, Any]:
        # Always listed, even empty: clients read ``errors`` off every invalid-request problem.
        return {"errors": self.errors}


class Unauthorized(AgentError):
    """No bearer token, or one the agent does not know."""


class Forbidden(AgentError):
    """The caller is known but may not do this; ``scope`` names what it lacks."""

    def __init__(self, detail: str, *, scope: str | None = None) -> None:
        super().__init__(detail)
        self.scope = scope

    def _fields(self) -> dict[str, Any]:
        return {"scope": self.scope}


class Conflict(AgentError):
    """The request is well-formed but the node's state refuses it (a GPU busy with a
    transition, instances in use, a claim prepared with other devices)."""

    def __init__(self, detail: str, *, gpu: str | None = None, claim: str | None = None,
                 transition: str | None = None,
                 blockers: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(detail)
        self.gpu = gpu
        self.claim = claim
        self.transition = transition
        self.blockers: tuple[Mapping[str, Any], ...] = tuple(blockers)

    def _fields(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "claim": self.claim, "transition": self.transition,
                "blockers": [dict(b) for b in self.blockers]}


class SelectionUnsatisfiable(Conflict):
    """A topology selection cannot be met with the GPUs that can be chosen now: ``gpus`` are
    the required ones that cannot, ``available`` the usable indices, ``excluded`` why each
    other GPU is out."""

    def __init__(self, detail: str, *, gpus: Sequence[int] = (),
                 available: Sequence[int] = (), excluded: Mapping[int, str] | None = None) -> None:
        super().__init__(detail)
        self.gpus = tuple(gpus)
        self.available = tuple(available)
        self.excluded: dict[int, str] = dict(excluded or {})

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "gpus": list(self.gpus), "available": list(self.available),
                "excluded": self.excluded}


class ProcessesRunning(Conflict):
    """Processes hold a GPU (or every GPU, for a driver reload) that the change needs idle."""

    def __init__(self, detail: str, *, pids: Sequence[int], gpu: str | None = None) -> None:
        super().__init__(detail, gpu=gpu)
        self.pids = tuple(pids)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "pids": list(self.pids)}


class DeviceBusy(Conflict):
    """A device another claim holds, or one being drained for a geometry change: ``holders``
    are the claims that hold it."""

    def __init__(self, detail: str, *, device: str | None = None, gpu: str | None = None,
                 holders: Sequence[str] = (), transition: str | None = None) -> None:
        super().__init__(detail, gpu=gpu, transition=transition)
        self.device = device
        self.holders = tuple(holders)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "device": self.device, "holders": list(self.holders)}


class MigNotEnabled(Conflict):
    """A MIG slice was asked for, but no GPU it may go on has MIG enabled (and none can switch
    it on for this request): ``profile`` is the slice, ``mig_off`` the indices of the
    MIG-capable GPUs with MIG off (enabling MIG on one, or asking for a whole GPU, helps)."""

    def __init__(self, detail: str, *, profile: str, mig_off: Sequence[int] = (),
                 gpu: str | None = None) -> None:
        super().__init__(detail, gpu=gpu)
        self.profile = profile
        self.mig_off = tuple(mig_off)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "profile": self.profile, "mig_off": list(self.mig_off)}


class MigModeNeedsExplicit(Conflict):
    """The change would switch MIG mode on a GPU whose mode changes only with a reset
    (Ampere), and the request did not ask for the mode: ``mig_enabled`` is the mode to ask
    for explicitly."""

    def __init__(self, detail: str, *, mig_enabled: bool, gpu: str | None = None) -> None:
        super().__init__(detail, gpu=gpu)
        self.mig_enabled = mig_enabled

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "mig_enabled": self.mig_enabled}


class NoSliceRoom(Conflict):
    """Every MIG-enabled GPU a slice may go on is full for it (no free placement, or the
    profile's instance limit): ``profile`` and ``start`` are what was asked, ``gpus`` the
    MIG-enabled GPUs tried, ``mig_off`` the MIG-capable GPUs with MIG off."""

    def __init__(self, detail: str, *, profile: str, start: int | None = None,
                 gpus: Sequence[int] = (), mig_off: Sequence[int] = (),
                 gpu: str | None = None) -> None:
        super().__init__(detail, gpu=gpu)
        self.profile = profile
        self.start = start
        self.gpus = tuple(gpus)
        self.mig_off = tuple(mig_off)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "profile": self.profile, "start": self.start,
                "gpus": list(self.gpus), "mig_off": list(self.mig_off)}


class DeviceUnavailable(Conflict):
    """A device or GPU that cannot be used at all right now, whoever asks: unhealthy (the
    reason names the XID), quarantined, lost, or draining. ``reason`` says which, in words."""

    def __init__(self, detail: str, *, gpu: str | None = None, device: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(detail, gpu=gpu)
        self.device = device
        self.reason = reason

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "device": self.device, "reason": self.reason}


class ClaimUnprepared(Conflict):
    """A prepare for a claim UID that was unprepared moments ago: a stale retry, refused so it
    cannot resurrect the claim (Kubernetes never reuses a claim UID)."""

    def __init__(self, detail: str, *, claim: str | None = None) -> None:
        super().__init__(detail, claim=claim)


class ImexNotConfigured(Conflict):
    """A compute-domain call on a node without ``--imex-address``: ``setting`` names what to
    set."""

    def __init__(self, detail: str, *, setting: str = "imex_address") -> None:
        super().__init__(detail)
        self.setting = setting

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "setting": self.setting}


class DomainBusy(Conflict):
    """This node is a member of another compute domain (one at a time), or claims still hold
    the domain: ``domain`` names it, ``holders`` the claims holding it here."""

    def __init__(self, detail: str, *, domain: str, claim: str | None = None,
                 holders: Sequence[str] = ()) -> None:
        super().__init__(detail, claim=claim)
        self.domain = domain
        self.holders = tuple(holders)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "domain": self.domain, "holders": list(self.holders)}


class DomainUnknown(Conflict):
    """A channel claim names a compute domain this node was not given (PUT it first)."""

    def __init__(self, detail: str, *, domain: str, claim: str | None = None) -> None:
        super().__init__(detail, claim=claim)
        self.domain = domain

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "domain": self.domain}


class ImexChannelMissing(Conflict):
    """The IMEX channel's device node, or its major in ``/proc/devices``, is not on the node."""

    def __init__(self, detail: str, *, path: str) -> None:
        super().__init__(detail)
        self.path = path

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "path": self.path}


class NotReady(AgentError):
    """The agent is up but cannot answer yet (NVML not initialised, recovery running); ask
    again in ``retry_after_s`` seconds."""

    def __init__(self, detail: str, *, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class Overloaded(NotReady):
    """The agent holds as many requests of this kind as it takes (long-polls on one
    listener); ask again in ``retry_after_s`` seconds."""


class SharingUnavailable(NotReady):
    """A GPU-sharing tool (``nvidia-cuda-mps-control``, ``nvidia-smi``) is missing or failed:
    ``tool`` names it, ``gpu`` the device when one is concerned, ``reason`` what went wrong."""

    def __init__(self, detail: str, *, tool: str, reason: str, gpu: str | None = None,
                 retry_after_s: int = 5) -> None:
        super().__init__(detail, retry_after_s=retry_after_s)
        self.tool = tool
        self.reason = reason
        self.gpu = gpu

    def _fields(self) -> dict[str, Any]:
        return {"tool": self.tool, "reason": self.reason,
                **({"gpu": self.gpu} if self.gpu is not None else {})}


class ImexUnavailable(NotReady):
    """This node's IMEX daemon could not be started, or did not become READY in time:
    ``reason`` says which, ``detail`` carries the daemon's own message."""

    def __init__(self, detail: str, *, reason: str, domain: str | None = None,
                 retry_after_s: int = 5) -> None:
        super().__init__(detail, retry_after_s=retry_after_s)
        self.reason = reason
        self.domain = domain

    def _fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "domain": self.domain}


class DeviceNodesMissing(NotReady):
    """A claim's devices have no device nodes yet (``/dev/nvidia*`` appear late on a freshly
    booted node): nothing was prepared; ask again in ``retry_after_s`` seconds."""

    def __init__(self, detail: str, *, claim: str, missing: Sequence[str],
                 retry_after_s: int = 2) -> None:
        super().__init__(detail, retry_after_s=retry_after_s)
        self.claim = claim
        self.missing = list(missing)

    def _fields(self) -> dict[str, Any]:
        return {"claim": self.claim, "missing": self.missing}


class StateLocked(AgentError):
    """Another agent process holds the state directory."""

    def __init__(self, *, path: str, holder_pid: str) -> None:
        super().__init__(
            f"another gpu-agent (pid {holder_pid}) holds {path}; one agent per state directory")
        self.path = path
        self.holder_pid = holder_pid

    def _fields(self) -> dict[str, Any]:
        return {"path": self.path, "holder_pid": self.holder_pid}


class StateUnreadable(AgentError):
    """A state file the agent owns exists but cannot be read (wrong type of path, permission,
    I/O error, a version it does not understand): ``reason`` says which. What it held is
    unknown, so whatever depends on it fails closed."""

    def __init__(self, detail: str, *, path: str, reason: str | None = None) -> None:
        super().__init__(detail)
        self.path = path
        self.reason = reason

    def _fields(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


class NvmlError(AgentError):
    """An NVML call failed. ``code`` is the NVML return code, ``function`` the NVML function,
    ``name`` the code's NVML name (``NVML_ERROR_...``)."""

    def __init__(self, *, function: str, code: int, name: str, gpu: str | None = None) -> None:
        where = f" on {gpu}" if gpu else ""
        super().__init__(f"{function}{where} failed: {name} ({code})")
        self.function = function
        self.code = code
        self.name = name
        self.gpu = gpu

    def _fields(self) -> dict[str, Any]:
        return {"function": self.function, "code": self.code, "nvml_error": self.name,
                "gpu": self.gpu}


class GpuLost(NvmlError):
    """The GPU answered ``NVML_ERROR_GPU_IS_LOST``: it has fallen off the bus."""


class BadRequest(AgentError):
    """The request is not what the endpoint reads at all (not JSON, wrong content type, an
    unknown query parameter); ``errors`` names the offending parts when there are several."""

    def __init__(self, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.errors = errors or []

    def _fields(self) -> dict[str, Any]:
        return {"errors": self.errors or None}


class GeometryNotPlaceable(AgentError):
    """A desired MIG geometry cannot be placed on the GPU; ``detail`` says why in words."""


class CheckpointUnusable(AgentError):
    """The claims checkpoint was corrupt and kept aside; claims stay frozen until an operator
    acts."""


class SlicesInvalid(AgentError):
    """The ResourceSlices the agent rendered break Kubernetes validation rules: a bug in the
    agent, never sent out. ``problems`` lists every rule broken."""

    def __init__(self, detail: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(detail)
        self.problems = tuple(problems)

    def _fields(self) -> dict[str, Any]:
        return {"problems": list(self.problems)}


class StorageUnavailable(AgentError, OSError):
    """A durable write to the state directory failed (disk full, read-only, I/O error): the
    change was not made and nothing was acknowledged. Still an :class:`OSError` (same
    ``errno``) for callers that handle those."""

    def __init__(self, path: str, err: OSError) -> None:
        name = errno.errorcode.get(err.errno or 0, "EIO")
        AgentError.__init__(
            self, f"cannot write {path}: {err.strerror or err} ({name}); the change was not "
            "made. Free space or fix the state directory, then retry.")
        self.path = path
        self.errno = err.errno
        self.strerror = err.strerror
        self.errno_name = name

    def _fields(self) -> dict[str, Any]:
        return {"path": self.path, "errno": self.errno_name}
