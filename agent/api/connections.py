"""Connections from hostile peers: a bounded number per listener, a deadline for each
request's head and body, and an idle keep-alive timeout.

aiohttp has no header-read timeout and no connection cap: a few hundred sockets that open and
trickle a byte now and then hold as many descriptors for as long as they like, and once the
process runs out, every listener stops accepting (``/healthz`` on the Unix socket included).
Here each listener runs its own accept loop and hands each connection to a protocol that
wraps aiohttp's request handler:

- a listener holds at most ``cap`` connections; at the cap it stops accepting until one
  closes, so the excess waits in the kernel's listen backlog (no descriptor, no CPU) or is
  refused by the kernel (the metrics listener, open to the pod network without a token,
  gets a smaller cap);
- a request's head (request line and headers) must arrive within ``header_timeout_s`` of its
  first byte (of the connection's start, for the first request), and a body with a
  ``Content-Length`` within ``body_timeout_s`` of the head; else the connection is closed;
- between requests aiohttp's keep-alive timeout (:data:`IDLE_TIMEOUT_S`) closes idle
  connections. A request being handled is never timed out here.

The caps are derived from the process's descriptor limit (``RLIMIT_NOFILE``) so that the
listeners together can never exhaust it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import ssl
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from agent.api.problems import PROBLEM_BASE, PROBLEM_CONTENT_TYPE
from agent.settings import Listener

log = logging.getLogger("agent.api.connections")

#: Seconds an idle keep-alive connection stays open (aiohttp's own default is an hour).
IDLE_TIMEOUT_S = 15.0
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
#: Descriptors kept free for everything else the agent opens (state files, NVML, logs).
RESERVED_FDS = 128
#: Upper bounds of the caps, whatever the descriptor limit allows.
MAX_API_CONNECTIONS = 1024
MAX_METRICS_CONNECTIONS = 64
_MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """The caps of one agent's listeners and the read deadlines of every connection."""

    api_cap: int
    metrics_cap: int
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    @classmethod
    def for_process(cls, api_listeners: int, *, metrics: bool) -> ConnectionLimits:
        """Caps that fit this process's soft ``RLIMIT_NOFILE``: the metrics listener takes at
        most an eighth of the spare descriptors, each API listener an equal share of half of
        the rest, so the listeners together never take all of them."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        spare = max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - RESERVED_FDS)
        metrics_cap = min(MAX_METRICS_CONNECTIONS, max(4, spare // 8)) if metrics else 0
        api_cap = min(MAX_API_CONNECTIONS,
                      max(4, (spare - metrics_cap) // (2 * max(1, api_listeners))))
        return cls(api_cap=api_cap, metrics_cap=metrics_cap)


class _Gate:
    """One listener's open connections (counted from accept to close) and its cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0
        self._freed: asyncio.Event | None = None

    def take(self) -> None:
        self.open += 1

    def release(self) -> None:
        self.open -= 1
        if self._freed is not None:
            self._freed.set()

    async def wait_for_room(self) -> None:
        while self.open >= self.cap:
            self._freed = asyncio.Event()
            await self._freed.wait()


class _ProblemHandler(RequestHandler):
    """aiohttp's request handler, answering the requests it refuses itself (a request line or
    header it cannot parse, a bad ``Content-Length``) with a problem like every other 4xx,
    and logging each in one line instead of a traceback a peer could fill the log with."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        text = exc.message if isinstance(exc, HttpProcessingError) else message
        reason = (str(text or "").strip().splitlines() or ["malformed request"])[0]
        reason = reason[:120].rstrip(":")
        log.info("malformed request refused", extra={"status": status, "reason": reason,
                                                     "peer": request.remote or "unix"})
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ \
            else "Error"
        kind = "internal-error" if status >= 500 else phrase.lower().replace(" ", "-")
        body = {"type": PROBLEM_BASE + kind, "title": phrase, "status": status,
                "detail": reason if status < 500 else "the agent failed unexpectedly"}
        response = web.Response(status=status, text=json.dumps(body),
                                content_type=PROBLEM_CONTENT_TYPE)
        response.force_close()
        return response


class _Guarded(asyncio.Protocol):
    """aiohttp's request handler behind the listener's cap and the read deadlines.

    It follows the request framing only as far as the deadlines need: the head ends at the
    first blank line, a ``Content-Length`` body is counted, and a chunked body (or anything
    it cannot frame) ends the deadlines for the rest of the connection (aiohttp still limits
    the body's size)."""

    def __init__(self, inner: Any, gate: _Gate, limits: ConnectionLimits) -> None:
        self._inner = inner
        self._gate = gate
        self._limits = limits
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self._done = False
        self._state = "head"  # head | body | idle | untracked
        self._head = b""
        self._body_left = 0

    # --- asyncio.Protocol -------------------------------------------------------------

    @property
    def made(self) -> bool:
        """Whether the connection reached the handler (a TLS handshake can fail before)."""
        return self._admitted or self._done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._admitted = True
        self._transport = transport
        self._arm(self._limits.header_timeout_s)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        self._frame(data)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._admitted:
            return None
        result: bool | None = self._inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._done = True
        self._gate.release()
        self._disarm()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    # --- deadlines --------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _frame(self, data: bytes) -> None:
        # Each step that starts or ends a deadline only notes it; the deadline of the state the
        # chunk leaves the request in is set once at the end (the same instant): a whole
        # request in one chunk, the usual case, arms and cancels no timer.
        moved = False
        view = data
        while view and self._state != "untracked":
            if self._state == "idle":
                self._state = "head"  # a new request: its head's deadline starts now
                self._head = b""
                moved = True
            if self._state == "head":
                joined = self._head + view
                end = joined.find(b"\r\n\r\n")
                if end < 0:
                    self._head = joined[-_MAX_HEAD_BYTES:]
                    break
                head, view = joined[:end], joined[end + 4:]
                self._head = b""
                self._body_left = _content_length(head)
                moved = True
                if self._body_left < 0:
                    self._state = "untracked"
                elif self._body_left == 0:
                    self._state = "idle"
                else:
                    self._state = "body"  # the body's deadline starts now
            elif self._state == "body":
                taken = min(len(view), self._body_left)
                self._body_left -= taken
                view = view[taken:]
                if self._body_left == 0:
                    self._state = "idle"
                    moved = True
        if not moved:
            return
        if self._state == "head":
            self._arm(self._limits.header_timeout_s)
        elif self._state == "body":
            self._arm(self._limits.body_timeout_s)
        else:
            self._disarm()


def _content_length(head: bytes) -> int:
    """The body length a request head announces: 0 for none, -1 for a body this guard does
    not frame (chunked, or a length it cannot read; aiohttp answers those itself)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return -1
        if name == b"content-length":
            text = value.strip()
            if not text.isdigit() or len(text) > 18:
                return -1
            length = int(text)
    return length


class GuardedSite(web.BaseSite):
    """A listener (TCP or Unix socket) of an aiohttp runner, with a connection cap and read
    deadlines; ``addresses`` are what it bound (the port is only known once started)."""

    __slots__ = ("_gate", "_limits", "_listener", "_sockets", "_tasks")

    def __init__(self, runner: web.BaseRunner, listener: Listener, *, cap: int,
                 limits: ConnectionLimits, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=512)
        self._listener = listener
        self._gate = _Gate(cap)
        self._limits = limits
        self._sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        if self._listener.path is not None:
            return f"unix:{self._listener.path}"
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._listener.host}:{self._listener.port}"

    @property
    def open_connections(self) -> int:
        return self._gate.open

    async def start(self) -> None:
        await super().start()
        self._sockets = self._bind()
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            self._spawn(loop, self._accept(sock))

    def _bind(self) -> list[socket.socket]:
        if self._listener.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self._listener.path))
            sock.listen(self._backlog)
            sock.setblocking(False)
            return [sock]
        bound: list[socket.socket] = []
        infos = socket.getaddrinfo(self._listener.host or None, self._listener.port or 0,
                                   type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen: set[tuple[Any, ...]] = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                bound.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
        except OSError:
            for sock in bound:
                sock.close()
            raise
        return bound

    def _spawn(self, loop: asyncio.AbstractEventLoop, work: Any) -> None:
        task = loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listening: socket.socket) -> None:
        """Accept while there is room; at the cap, wait for a connection to close."""
        loop = asyncio.get_running_loop()
        while True:
            await self._gate.wait_for_room()
            try:
                conn, _ = await loop.sock_accept(listening)
            except OSError as err:  # EMFILE and the like: back off rather than spin
                log.warning("accept failed", extra={"listener": self.name,
                                                    "error": err.strerror})
                await asyncio.sleep(0.5)
                continue
            conn.setblocking(False)
            self._gate.take()
            self._spawn(loop, self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        handler = server()
        # Same layout (no slots added), so the class can be swapped on what aiohttp made with
        # the runner's settings; aiohttp offers no handler class to configure.
        handler.__class__ = _ProblemHandler
        protocol = _Guarded(handler, self._gate, self._limits)
        handshake = self._limits.header_timeout_s if self._ssl_context else None
        try:
            await loop.connect_accepted_socket(lambda: protocol, conn, ssl=self._ssl_context,
                                               ssl_handshake_timeout=handshake)
        except (OSError, TimeoutError, asyncio.CancelledError):
            # A failed TLS handshake (or a peer already gone) never reached the protocol.
            conn.close()
            if not protocol.made:
                self._gate.release()

    async def stop(self) -> None:
        for sock in self._sockets:
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        self._sockets = []
        await super().stop()

    def addresses(self) -> list[str]:
        """``unix:PATH`` or ``http(s)://host:port`` for each bound socket."""
        if self._listener.path is not None:
            return [f"unix:{Path(self._listener.path)}"]
        scheme = "https" if self._ssl_context else "http"
        bound = []
        for sock in self._sockets:
            host, port = sock.getsockname()[:2]
            bound.append(f"{scheme}://[{host}]:{port}" if ":" in host
                         else f"{scheme}://{host}:{port}")
        return bound
