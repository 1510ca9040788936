"""Requests sent to a (re)starting agent from the moment its Unix socket accepts, the way
kubelet retries prepares the moment a plugin socket appears, and the readiness-gate invariant
their answers must keep: before ready, every mutation and every read of reconciled state is
503 ``not-ready`` with an integer ``Retry-After``; nothing is acknowledged before ready.

Each request is followed by ``GET /readyz`` on a new connection. Readiness only goes from
503 to 200 during start-up, so an answer followed by a 503 from ``/readyz`` was certainly
given before ready; those are the answers the invariant judges.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agent_process import Reply, exchange

NOT_READY = "https://gpu.nodeagent.dev/problems/not-ready"
#: Paths whose answers the gate must hold back before ready even for GET (reconciled state).
RECONCILED_READS = ("/v1/claims", "/v1/cdi", "/v1/transitions", "/v1/mig/apply",
                    "/v1/resourceslices")


@dataclass(frozen=True)
class Call:
    """One request the client sends, over and over until the agent is ready."""

    method: str
    path: str
    body: Any = None

    @property
    def gated(self) -> bool:
        """Whether the readiness gate must answer it 503 before ready."""
        if self.path.startswith("/v1/sim"):
            return False  # the simulator's controls are test machinery, not agent state
        if self.method != "GET":
            return True
        bare = self.path.split("?", 1)[0]
        return bare.startswith(RECONCILED_READS) or (
            bare.startswith("/v1/gpus/") and bare.endswith("/mig"))


@dataclass(frozen=True)
class Answer:
    call: Call
    status: int
    headers: dict[str, str]
    body: Any
    before_ready: bool
    """``/readyz`` still answered 503 after this answer arrived."""


@dataclass
class FromBind:
    """The answers a client got from the socket's first accept until the agent was ready."""

    answers: list[Answer] = field(default_factory=list)
    first_accept: float | None = None
    ready_at: float | None = None
    died: str | None = None

    def early(self) -> list[Answer]:
        return [a for a in self.answers if a.before_ready and a.call.gated]

    def violations(self) -> list[str]:
        """Answers given before ready that break the gate, as readable lines."""
        found = []
        for a in self.early():
            kind = a.body.get("type") if isinstance(a.body, dict) else None
            retry = a.headers.get("retry-after", "")
            if a.status != 503 or kind != NOT_READY or not retry.isdigit():
                found.append(f"{a.call.method} {a.call.path} before ready: {a.status} "
                             f"type={kind} retry-after={retry!r} {str(a.body)[:200]}")
        return found

    def acknowledged(self, method: str = "PUT") -> list[Answer]:
        return [a for a in self.answers if a.call.method == method and 200 <= a.status < 300]


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def unix_request(sock: Path, method: str, path: str, body: Any = None, *,
                 token: str | None = None, timeout: float = 30) -> Reply:
    """One HTTP request over a Unix socket (``OSError`` while nothing accepts there)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    return exchange(_Unix(sock, timeout), method, path, data, headers)


def send_from_bind(sock: Path, token: str | None, calls: Sequence[Call] | Callable[[int], Call],
                   *, timeout: float = 30, after_ready: int = 0, pause: float = 0.02,
                   on_first_accept: Callable[[], None] | None = None) -> FromBind:
    """Connect-retry on ``sock`` (a stale socket file refuses until the agent binds), then send
    ``calls`` round-robin (or ``calls(n)`` for the n-th), each followed by a ``/readyz`` probe,
    until ``/readyz`` answers 200 and ``after_ready`` more calls went out. Stops early if the
    agent stops answering (``died`` says how)."""
    result = FromBind()
    deadline = time.monotonic() + timeout
    while True:
        try:
            unix_request(sock, "GET", "/healthz", timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                result.died = "the socket never accepted"
                return result
            time.sleep(0.005)
    result.first_accept = time.monotonic()
    if on_first_accept is not None:
        on_first_accept()
    n = 0
    left = after_ready
    while time.monotonic() < deadline:
        call = calls(n) if callable(calls) else calls[n % len(calls)]
        n += 1
        try:
            reply = unix_request(sock, call.method, call.path, call.body, token=token)
            ready = unix_request(sock, "GET", "/readyz").status == 200
        except (OSError, http.client.HTTPException) as err:
            result.died = f"{call.method} {call.path}: {err!r}"
            return result
        result.answers.append(Answer(call, reply.status, reply.headers, reply.body,
                                     before_ready=not ready))
        if ready:
            if result.ready_at is None:
                result.ready_at = time.monotonic()
            if left <= 0:
                return result
            left -= 1
        time.sleep(pause)  # a retrying caller, not a flood: the CPUs are shared
    result.died = f"not ready after {timeout}s"
    return result


class Background:
    """:func:`send_from_bind` on a thread, started before the agent so it misses nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.result: FromBind | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self.result = send_from_bind(*args, **kwargs)
            except BaseException as err:  # reported in join()
                self._error = err

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self, timeout: float = 60) -> FromBind:
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        if self.result is None:
            raise AssertionError("the from-bind client did not finish")
        return self.result
