"""Every error response is ``application/problem+json`` (RFC 9457), produced here and only here."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

from aiohttp import web
from pydantic import BaseModel

# Body parsing lives in agent.api.body; handlers import it from here too.
from agent.api.body import parse_body as parse_body  # noqa: PLC0414 - re-exported
from agent.api.context import MAX_BODY_BYTES, REQUEST_ID
from agent.errors import (
    AgentError,
    BadRequest,
    CheckpointUnusable,
    ClaimUnprepared,
    Conflict,
    DeviceBusy,
    DeviceNodesMissing,
    DeviceUnavailable,
    DomainBusy,
    DomainUnknown,
    Forbidden,
    GeometryNotPlaceable,
    GpuLost,
    ImexChannelMissing,
    ImexNotConfigured,
    ImexUnavailable,
    InvalidRequest,
    MigModeNeedsExplicit,
    MigNotEnabled,
    NoSliceRoom,
    NotFound,
    NotReady,
    NvmlError,
    Overloaded,
    SharingUnavailable,
    StateLocked,
    StateUnreadable,
    StorageUnavailable,
    Unauthorized,
)
from agent.gpu.sim.state import SimulatorStateError

log = logging.getLogger("agent.api")
M = TypeVar("M", bound=BaseModel)

PROBLEM_BASE = "https://gpu.nodeagent.dev/problems/"
PROBLEM_CONTENT_TYPE = "application/problem+json"
#: errnos of a state directory that cannot take a write: answered 507, not 500.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES,
                            errno.EPERM})


class Problem(NamedTuple):
    """How the API answers one kind of domain error."""

    status: int
    type_name: str
    """The last part of the problem ``type`` URI: stable, machine-readable."""
    title: str


#: The one mapping from domain errors to HTTP. Looked up along the class's MRO, so a subclass
#: without its own row answers like its parent (``SelectionUnsatisfiable`` is a ``conflict``).
#: Statuses and type names are public: clients and docs rely on them.
PROBLEMS: Mapping[type[AgentError], Problem] = {
    AgentError: Problem(500, "internal-error", "Internal error"),
    BadRequest: Problem(400, "bad-request", "Bad request"),
    Unauthorized: Problem(401, "unauthorized", "Unauthorized"),
    Forbidden: Problem(403, "forbidden", "Forbidden"),
    NotFound: Problem(404, "not-found", "Not found"),
    Conflict: Problem(409, "conflict", "Conflict"),
    DeviceBusy: Problem(409, "device-busy", "Device busy"),
    DeviceUnavailable: Problem(409, "device-unavailable", "Device unavailable"),
    MigNotEnabled: Problem(409, "mig-not-enabled", "MIG not enabled"),
    MigModeNeedsExplicit: Problem(409, "mig-mode-needs-explicit",
                                  "MIG mode change must be asked for"),
    NoSliceRoom: Problem(409, "no-slice-room", "No room for the MIG slice"),
    ClaimUnprepared: Problem(409, "claim-unprepared", "Claim was unprepared"),
    ImexNotConfigured: Problem(409, "imex-not-configured", "IMEX not configured"),
    DomainBusy: Problem(409, "domain-busy", "Node in another compute domain"),
    DomainUnknown: Problem(409, "domain-unknown", "Compute domain unknown"),
    ImexChannelMissing: Problem(409, "imex-channel-missing", "IMEX channel missing"),
    StateLocked: Problem(409, "state-locked", "State directory locked"),
    InvalidRequest: Problem(422, "invalid-request", "Invalid request"),
    GeometryNotPlaceable: Problem(422, "geometry-not-placeable",
                                  "MIG geometry cannot be placed"),
    SimulatorStateError: Problem(500, "simulator-state", "Simulator state unusable"),
    NvmlError: Problem(502, "nvml-error", "NVML call failed"),
    GpuLost: Problem(503, "gpu-lost", "GPU lost"),
    NotReady: Problem(503, "not-ready", "Not ready"),
    Overloaded: Problem(503, "overloaded", "Service Unavailable"),
    DeviceNodesMissing: Problem(503, "device-nodes-missing", "Device nodes not present yet"),
    SharingUnavailable: Problem(503, "sharing-unavailable", "GPU sharing tool unavailable"),
    ImexUnavailable: Problem(503, "imex-unavailable", "IMEX daemon not ready"),
    CheckpointUnusable: Problem(503, "checkpoint-corrupt", "Claims checkpoint unusable"),
    StateUnreadable: Problem(503, "state-unreadable", "State file unreadable"),
    StorageUnavailable: Problem(507, "insufficient-storage", "State directory not writable"),
}


def problem_of(err: AgentError | type[AgentError]) -> Problem:
    """The status, problem type and title the API answers ``err`` (or its class) with: the row
    of the nearest class in its MRO."""
    cls = err if isinstance(err, type) else type(err)
    for klass in cls.__mro__:
        row = PROBLEMS.get(klass)
        if row is not None:
            return row
    return PROBLEMS[AgentError]  # unreachable: AgentError has a row


def problem_headers(err: AgentError) -> dict[str, str] | None:
    """Headers a problem for ``err`` carries: when to retry, how to authenticate."""
    if isinstance(err, NotReady):
        return {"Retry-After": str(err.retry_after_s)}
    if isinstance(err, Unauthorized):
        return {"WWW-Authenticate": "Bearer"}
    return None


def error_response(request: web.Request, err: AgentError) -> web.Response:
    """The problem for a domain error, from the table and the error's own fields."""
    status, type_name, title = problem_of(err)
    response = problem_response(request, status=status, type_name=type_name, title=title,
                                detail=err.detail, extra=err.fields(),
                                headers=problem_headers(err))
    if isinstance(err, Overloaded):
        response.force_close()  # told to come back later, a caller holds no slot meanwhile
    return response


def problem_response(request: web.Request, *, status: int, type_name: str, title: str,
                     detail: str, extra: dict[str, Any] | None = None,
                     headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + type_name,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.path,
        "request_id": request.get(REQUEST_ID),
    }
    for key, value in (extra or {}).items():
        if value is not None:
            body.setdefault(key, value)
    return web.Response(status=status, text=json.dumps(body), content_type=PROBLEM_CONTENT_TYPE,
                        headers=headers)


@web.middleware
async def problem_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Map domain errors and aiohttp's HTTP errors to problems; an unexpected exception becomes
    a 500 problem with the request id, logged with its traceback."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except AgentError as err:
        return error_response(request, err)
    except OSError as err:
        if err.errno in STORAGE_ERRNOS:  # a durable write outside write_atomic's mapping
            return error_response(
                request, StorageUnavailable(str(err.filename or "the state directory"), err))
        return _internal_error(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        detail = {404: f"no route for {request.path}",
                  405: f"{request.method} is not allowed on {request.path}",
                  413: f"request body larger than {request.app[MAX_BODY_BYTES]} bytes"}.get(
                      exc.status, exc.text or exc.reason)
        return problem_response(request, status=exc.status,
                                type_name=exc.reason.lower().replace(" ", "-"),
                                title=exc.reason, detail=detail, headers=headers)
    except Exception:
        return _internal_error(request)


def _internal_error(request: web.Request) -> web.Response:
    """Called inside an ``except`` block: logs the traceback."""
    log.exception("unhandled error", extra={"request_id": request.get(REQUEST_ID),
                                            "path": request.path})
    status, type_name, title = PROBLEMS[AgentError]
    return problem_response(request, status=status, type_name=type_name, title=title,
                            detail="the agent failed unexpectedly; see its log for "
                                   f"request id {request.get(REQUEST_ID)}")
