"""Every error response is ``application/problem+json`` (RFC 9457), produced here and only here."""

from __future__ import annotations

import errno
import json
import logging
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

# Body parsing lives in agent.api.body; handlers import it from here too.
from agent.api.body import parse_body as parse_body  # noqa: PLC0414 - re-exported
from agent.api.context import MAX_BODY_BYTES, REQUEST_ID
from agent.errors import AgentError, InvalidRequest, StorageUnavailable

log = logging.getLogger("agent.api")
M = TypeVar("M", bound=BaseModel)

PROBLEM_BASE = "https://gpu.nodeagent.dev/problems/"
PROBLEM_CONTENT_TYPE = "application/problem+json"
#: errnos of a state directory that cannot take a write: answered 507, not 500.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES,
                            errno.EPERM})


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


def _field_errors(err: ValidationError) -> list[dict[str, Any]]:
    return [{"field": ".".join(str(p) for p in e["loc"]) or "(body)", "reason": e["msg"]}
            for e in err.errors(include_url=False, include_input=False)]


def validation_problem(err: ValidationError, what: str = "body") -> InvalidRequest:
    """A pydantic error as :class:`InvalidRequest` naming every offending field."""
    errors = _field_errors(err)
    first = errors[0]
    detail = f"invalid {what}: {first['field']}: {first['reason']}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return InvalidRequest(detail, errors)


@web.middleware
async def problem_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Map domain errors and aiohttp's HTTP errors to problems; an unexpected exception becomes
    a 500 problem with the request id, logged with its traceback."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except AgentError as err:
        return problem_response(request, status=err.status, type_name=err.type_name,
                                title=err.title, detail=err.detail, extra=err.extra,
                                headers={"WWW-Authenticate": "Bearer"} if err.status == 401
                                else None)
    except OSError as err:
        if err.errno in STORAGE_ERRNOS:  # a durable write outside write_atomic's mapping
            storage = StorageUnavailable(str(err.filename or "the state directory"), err)
            return problem_response(request, status=storage.status,
                                    type_name=storage.type_name, title=storage.title,
                                    detail=storage.detail, extra=storage.extra)
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
    return problem_response(request, status=500, type_name="internal-error",
                            title="Internal error",
                            detail="the agent failed unexpectedly; see its log for "
                                   f"request id {request.get(REQUEST_ID)}")
