"""The one table from domain errors to problems: every error class answers with a known status
and problem type, and its typed fields reach the problem body."""

from __future__ import annotations

import errno
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

import agent
from agent.api.problems import PROBLEM_CONTENT_TYPE, problem_middleware, problem_of
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
    ProcessesRunning,
    SelectionUnsatisfiable,
    SharingUnavailable,
    SlicesInvalid,
    StateLocked,
    StateUnreadable,
    StorageUnavailable,
    Unauthorized,
)
from agent.gpu.sim.state import SimulatorStateError

#: What clients and docs rely on: changing a row here is an API change.
EXPECTED: dict[type[AgentError], tuple[int, str]] = {
    AgentError: (500, "internal-error"),
    BadRequest: (400, "bad-request"),
    Unauthorized: (401, "unauthorized"),
    Forbidden: (403, "forbidden"),
    NotFound: (404, "not-found"),
    Conflict: (409, "conflict"),
    SelectionUnsatisfiable: (409, "conflict"),
    ProcessesRunning: (409, "conflict"),
    DeviceBusy: (409, "device-busy"),
    DeviceUnavailable: (409, "device-unavailable"),
    MigNotEnabled: (409, "mig-not-enabled"),
    MigModeNeedsExplicit: (409, "mig-mode-needs-explicit"),
    NoSliceRoom: (409, "no-slice-room"),
    ClaimUnprepared: (409, "claim-unprepared"),
    ImexNotConfigured: (409, "imex-not-configured"),
    DomainBusy: (409, "domain-busy"),
    DomainUnknown: (409, "domain-unknown"),
    ImexChannelMissing: (409, "imex-channel-missing"),
    ImexUnavailable: (503, "imex-unavailable"),
    StateLocked: (409, "state-locked"),
    InvalidRequest: (422, "invalid-request"),
    GeometryNotPlaceable: (422, "geometry-not-placeable"),
    SimulatorStateError: (500, "simulator-state"),
    SlicesInvalid: (500, "internal-error"),
    NvmlError: (502, "nvml-error"),
    GpuLost: (503, "gpu-lost"),
    NotReady: (503, "not-ready"),
    Overloaded: (503, "overloaded"),
    DeviceNodesMissing: (503, "device-nodes-missing"),
    SharingUnavailable: (503, "sharing-unavailable"),
    CheckpointUnusable: (503, "checkpoint-corrupt"),
    StateUnreadable: (503, "state-unreadable"),
    StorageUnavailable: (507, "insufficient-storage"),
}


def _subclasses(cls: type[AgentError]) -> Iterator[type[AgentError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _agent_error_classes() -> set[type[AgentError]]:
    """Every error class the agent defines, wherever it lives (so every module is imported)."""
    for module in pkgutil.walk_packages(agent.__path__, "agent."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    return {AgentError} | {c for c in _subclasses(AgentError) if c.__module__.startswith("agent.")}


def test_every_error_class_has_its_expected_problem() -> None:
    """Each AgentError subclass in agent/ resolves to the status and type listed here, and no
    class is missing from (or extra in) this list."""
    classes = _agent_error_classes()
    assert classes == set(EXPECTED)
    got = {cls.__qualname__: problem_of(cls)[:2] for cls in classes}
    assert got == {cls.__qualname__: row for cls, row in EXPECTED.items()}


def test_a_subclass_without_a_row_answers_like_its_parent() -> None:
    """The table is read along the MRO: a new subclass inherits its parent's problem."""

    class Brandnew(DeviceBusy):
        pass

    assert problem_of(Brandnew("x")) == problem_of(DeviceBusy)


def _oserror(code: int) -> OSError:
    return OSError(code, "No space left on device")


# (the error, the fields its problem body must carry exactly)
BODIES: list[tuple[AgentError, dict[str, Any]]] = [
    (DeviceBusy("held", device="nvidia0", holders=["c1"]),
     {"device": "nvidia0", "holders": ["c1"]}),
    (DeviceUnavailable("xid 48", gpu="GPU-1", reason="XID 48: double-bit ECC error"),
     {"gpu": "GPU-1", "reason": "XID 48: double-bit ECC error"}),
    (Conflict("busy", gpu="GPU-1", transition="t1"), {"gpu": "GPU-1", "transition": "t1"}),
    (SelectionUnsatisfiable("no", available=[1], excluded={2: "lost"}),
     {"available": [1], "excluded": {"2": "lost"}}),
    (ProcessesRunning("pids", gpu="GPU-1", pids=[7]), {"gpu": "GPU-1", "pids": [7]}),
    (ClaimUnprepared("late", claim="c1"), {"claim": "c1"}),
    (DomainBusy("busy", domain="job-1", claim="c1"), {"claim": "c1", "domain": "job-1"}),
    (ImexUnavailable("down", reason="not ready", domain="d"),
     {"reason": "not ready", "domain": "d"}),
    (MigModeNeedsExplicit("ampere", mig_enabled=False, gpu="GPU-1"),
     {"gpu": "GPU-1", "mig_enabled": False}),
    (NotFound("no claim", claim="c1"), {"claim": "c1"}),
    (InvalidRequest("bad"), {"errors": []}),
    (InvalidRequest("bad", [{"field": "count", "reason": "too big"}]),
     {"errors": [{"field": "count", "reason": "too big"}]}),
    (Forbidden("no", scope="admin"), {"scope": "admin"}),
    (NotReady("recovering", retry_after_s=5), {}),
    (StateLocked(path="/s/agent.lock", holder_pid="42"),
     {"path": "/s/agent.lock", "holder_pid": "42"}),
    (StateUnreadable("is a directory", path="/s/claims.json", reason="EISDIR"),
     {"path": "/s/claims.json", "reason": "EISDIR"}),
    (NvmlError(function="nvmlDeviceGetName", code=999, name="NVML_ERROR_UNKNOWN"),
     {"function": "nvmlDeviceGetName", "code": 999, "nvml_error": "NVML_ERROR_UNKNOWN"}),
    (GpuLost(function="nvmlDeviceGetName", code=15, name="NVML_ERROR_GPU_IS_LOST", gpu="GPU-1"),
     {"function": "nvmlDeviceGetName", "code": 15, "nvml_error": "NVML_ERROR_GPU_IS_LOST",
      "gpu": "GPU-1"}),
    (StorageUnavailable("/s/claims.json", _oserror(errno.ENOSPC)),
     {"path": "/s/claims.json", "errno": "ENOSPC"}),
    (SlicesInvalid("broken", problems=["a", "b"]), {"problems": ["a", "b"]}),
    (GeometryNotPlaceable("too many"), {}),
]

BASE_KEYS = {"type", "title", "status", "detail", "instance", "request_id"}


@pytest.fixture
async def raising(aiohttp_client: Callable[..., Any]) -> Callable[[AgentError], Any]:
    """A client whose one route raises the error it is handed."""
    current: list[AgentError] = []

    async def handler(request: web.Request) -> web.Response:
        raise current[-1]

    app = web.Application(middlewares=[problem_middleware])
    app.router.add_get("/e", handler)
    client: TestClient[Any, Any] = await aiohttp_client(app)

    async def get(err: AgentError) -> Any:
        current.append(err)
        return await client.get("/e")

    return get


@pytest.mark.parametrize(("err", "fields"), BODIES,
                         ids=[type(err).__name__ for err, _ in BODIES])
async def test_problem_body_has_the_table_row_and_the_errors_fields(
        raising: Callable[[AgentError], Any], err: AgentError, fields: dict[str, Any]) -> None:
    """A raised domain error answers with its row's status, type and title, its detail, and
    exactly its non-empty typed fields."""
    reply = await raising(err)
    status, type_name, title = problem_of(err)
    assert reply.status == status
    assert reply.content_type == PROBLEM_CONTENT_TYPE
    body = await reply.json(content_type=PROBLEM_CONTENT_TYPE)
    assert body["type"].endswith("/" + type_name) and body["title"] == title
    assert body["status"] == status and body["detail"] == err.detail
    assert {k: v for k, v in body.items() if k not in BASE_KEYS} == fields


@pytest.mark.parametrize(("err", "header", "value"), [
    (NotReady("recovering"), "Retry-After", "1"),
    (NotReady("recovering", retry_after_s=7), "Retry-After", "7"),
    (Unauthorized("missing bearer token"), "WWW-Authenticate", "Bearer"),
])
async def test_problems_carry_their_headers(raising: Callable[[AgentError], Any],
                                            err: AgentError, header: str, value: str) -> None:
    """A not-ready problem says when to retry; an unauthorised one how to authenticate."""
    reply = await raising(err)
    assert reply.headers[header] == value


async def test_other_problems_carry_neither_header(raising: Callable[[AgentError], Any]) -> None:
    """Retry-After and WWW-Authenticate are only where they mean something."""
    reply = await raising(Conflict("busy"))
    assert "Retry-After" not in reply.headers and "WWW-Authenticate" not in reply.headers
