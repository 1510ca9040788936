"""Connections from hostile peers: a bounded number per listener, probes answered however
the listener is flooded, a deadline for each request's head and body, and an idle keep-alive
timeout.

aiohttp has no header-read timeout and no connection cap: a few hundred sockets that open and
trickle a byte now and then hold as many descriptors for as long as they like, and once the
process runs out, every listener stops accepting (``/healthz`` on the Unix socket included).
Here each listener runs its own accept loop, never stops accepting, and places each
connection it accepts (:class:`ListenerCaps` has the sizes):

- under the cap it is **served**: handed to aiohttp's request handler;
- past the cap its first bytes are read at once (on plain connections: a client sends its
  request as soon as it connects) and :func:`sort_request` says what it asks for: a
  liveness or readiness probe (``GET /healthz``, ``GET /readyz``, no body) is served in one
  of a few **reserved** slots, for that one request, then closed; anything else is answered
  ``503`` with ``Retry-After`` and closed. One whose request line is not in yet (or a TLS
  connection, which is read only after its handshake) **waits** in a small room until it
  is (served if a slot freed meanwhile); when the room is full, the one that has waited
  longest is answered ``503`` and closed. So a flood of slow sockets holds the served slots
  at most, every connection past them leaves as soon as its request line is read, and a
  probe always finds a reserved slot: each holds its connection for one answer only;
- a request's head (request line and headers) must arrive within ``header_timeout_s`` of its
  first byte (of the connection's start, for the first request), and a body with a
  ``Content-Length`` within ``body_timeout_s`` of the head; else the connection is closed
  (a waiting one answered ``503``);
- between requests aiohttp's keep-alive timeout (:data:`IDLE_TIMEOUT_S`) closes idle
  connections. A request being handled is never timed out here;
- a request its handler holds open (a long-poll, :func:`long_poll`) counts against the
  listener's long-poll cap, half its served slots: past it the request is answered ``503``
  with ``Retry-After`` at once, so long-polls never take every slot.

The sizes are derived from the process's descriptor limit (``RLIMIT_NOFILE``) so that the
listeners together can never exhaust it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import resource
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from agent.api.problems import PROBLEM_BASE, PROBLEM_CONTENT_TYPE
from agent.errors import Overloaded
from agent.settings import Listener

log = logging.getLogger("agent.api.connections")

#: Seconds an idle keep-alive connection stays open (aiohttp's own default is an hour).
IDLE_TIMEOUT_S = 15.0
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
#: Descriptors kept free for everything else the agent opens (state files, NVML, logs).
RESERVED_FDS = 128
#: Upper bounds of a listener's descriptors, whatever the descriptor limit allows.
MAX_API_CONNECTIONS = 1024
MAX_METRICS_CONNECTIONS = 64
#: What a client is told to wait before it asks again, once refused for the connection cap
#: (a slot frees as soon as any request ends) and for the long-poll cap (one frees when a
#: long-poll ends: seconds later).
RETRY_AFTER_S = 1
LONG_POLL_RETRY_AFTER_S = 5
#: Connections one turn of the event loop accepts at most.
_ACCEPTS_PER_TURN = 128
#: The kernel's queue of connections not accepted yet (capped by net.core.somaxconn; no
#: descriptors): deep enough that a burst of a few thousand connections is not dropped,
#: which would leave a probe's connect to TCP's one-second SYN retry.
_BACKLOG = 4096
#: Paths of the probes served in the reserved slots (on the API and the metrics listeners).
PROBE_PATHS = frozenset({b"/healthz", b"/readyz"})
_MAX_HEAD_BYTES = 64 * 1024
#: Bytes a waiting connection may send before its request line (or a probe's head) ends.
_MAX_WAITING_BYTES = 8 * 1024
#: Seconds a connection waits for its request line before a newer one may take its place in
#: a full room (any client sends at once: this is for one that is slow to be scheduled).
WAITING_GRACE_S = 0.1


@dataclass(frozen=True)
class ListenerCaps:
    """How many connections one listener holds, by place: ``served`` under the cap,
    ``waiting`` (their request line still unread) past it, ``reserved`` for probes past it;
    and how many of the served ones may be held by a long-poll. Together they are the most
    descriptors the listener takes."""

    served: int
    waiting: int
    reserved: int
    long_polls: int

    @classmethod
    def within(cls, descriptors: int) -> ListenerCaps:
        """The split of ``descriptors``: an eighth waiting, up to 4 reserved, the rest
        served, half of those at most long-polls."""
        waiting = max(2, descriptors // 8)
        reserved = max(1, min(4, descriptors // 16))
        served = max(2, descriptors - waiting - reserved)
        return cls(served=served, waiting=waiting, reserved=reserved,
                   long_polls=max(1, served // 2))

    @property
    def descriptors(self) -> int:
        return self.served + self.waiting + self.reserved


@dataclass(frozen=True)
class ConnectionLimits:
    """The caps of one agent's listeners (each API listener ``api``, the metrics listener
    ``metrics``) and the read deadlines of every connection."""

    api: ListenerCaps
    metrics: ListenerCaps
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    @classmethod
    def for_process(cls, api_listeners: int, *, metrics: bool) -> ConnectionLimits:
        """Caps that fit this process's soft ``RLIMIT_NOFILE``: the metrics listener takes at
        most an eighth of the spare descriptors, each API listener an equal share of half of
        the rest, so the listeners together never take all of them."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        spare = max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - RESERVED_FDS)
        metrics_fds = min(MAX_METRICS_CONNECTIONS, max(4, spare // 8)) if metrics else 0
        api_fds = min(MAX_API_CONNECTIONS,
                      max(4, (spare - metrics_fds) // (2 * max(1, api_listeners))))
        return cls(api=ListenerCaps.within(api_fds),
                   metrics=ListenerCaps.within(max(4, metrics_fds)))


class Place(enum.Enum):
    """Where a listener holds a connection (see the module's docstring)."""

    SERVED = "served"
    WAITING = "waiting"
    RESERVED = "reserved"


class Request(enum.Enum):
    """What a connection past the cap asks for, from its first bytes."""

    INCOMPLETE = "incomplete"  # its request line (a probe's whole head) is not in yet
    PROBE = "probe"  # GET or HEAD of a probe path, without a body
    OTHER = "other"


def sort_request(kept: bytes) -> Request:
    """What the first bytes of a connection ask for. A probe with a body is not one: aiohttp
    would read the body before it answers."""
    line_end = kept.find(b"\r\n")
    if line_end < 0:
        return Request.INCOMPLETE
    method, _, rest = kept[:line_end].partition(b" ")
    target = rest.partition(b" ")[0]
    if method not in (b"GET", b"HEAD") or target.partition(b"?")[0] not in PROBE_PATHS:
        return Request.OTHER
    head_end = kept.find(b"\r\n\r\n")
    if head_end < 0:
        return Request.INCOMPLETE
    return Request.PROBE if _content_length(kept[:head_end]) == 0 else Request.OTHER


class _Gate:
    """One listener's connections by place (counted from accept to close) and its long-polls;
    the waiting ones in the order they came."""

    def __init__(self, caps: ListenerCaps) -> None:
        self.caps = caps
        self.served = 0
        self.reserved = 0
        self.waiting: dict[_Guarded, None] = {}
        self.long_polls = 0
        self.refusal = _refusal(caps)
        self._changed = asyncio.Event()  # set whenever a connection leaves its place

    @property
    def full(self) -> bool:
        """Whether every served slot is taken."""
        return self.served >= self.caps.served

    def place(self, guard: _Guarded, request: Request) -> Place | None:
        """Where a connection goes (or goes on): served under the cap; past it, a probe to
        a reserved slot while one is free, and one whose request is incomplete to wait (the
        one that has waited longest refused when the room is full). None: it is refused."""
        self.release(guard)
        if not self.full:
            self._take(guard, Place.SERVED)
        elif request is Request.PROBE:
            if self.reserved < self.caps.reserved:
                self._take(guard, Place.RESERVED)
        elif request is Request.INCOMPLETE and not self.room_full:
            self._take(guard, Place.WAITING)
        return guard.place

    @property
    def room_full(self) -> bool:
        """Whether the waiting room is full."""
        return len(self.waiting) >= self.caps.waiting

    async def make_room(self) -> None:
        """Return once a connection accepted now has a place: a served slot, or room to
        wait. While the room is full, the one that has waited longest is refused as soon
        as its grace is over."""
        loop = asyncio.get_running_loop()
        while self.full and self.room_full:
            oldest = next(iter(self.waiting))
            left = oldest.since + WAITING_GRACE_S - loop.time()
            if left <= 0:
                oldest.refuse()
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _take(self, guard: _Guarded, place: Place) -> None:
        guard.place = place
        if place is Place.SERVED:
            self.served += 1
        elif place is Place.RESERVED:
            self.reserved += 1
        else:
            self.waiting[guard] = None
            guard.since = asyncio.get_running_loop().time()

    def release(self, guard: _Guarded) -> None:
        """The connection no longer holds its place (closed, refused, or placed anew)."""
        place, guard.place = guard.place, None
        if place is not None:
            self._changed.set()
        if place is Place.SERVED:
            self.served -= 1
        elif place is Place.RESERVED:
            self.reserved -= 1
        elif place is Place.WAITING:
            del self.waiting[guard]

    def hold(self) -> None:
        """One more long-poll held, or :class:`Overloaded` when the listener has its cap."""
        if self.long_polls >= self.caps.long_polls:
            raise Overloaded(f"this listener holds its maximum of {self.caps.long_polls} "
                             "waiting requests; ask again later or without wait_s",
                             retry_after_s=LONG_POLL_RETRY_AFTER_S)
        self.long_polls += 1

    def unhold(self) -> None:
        self.long_polls -= 1


def _refusal(caps: ListenerCaps) -> bytes:
    """The answer of a connection past the cap: a 503 problem, then the connection closes."""
    body = json.dumps({
        "type": PROBLEM_BASE + "overloaded", "title": "Service Unavailable", "status": 503,
        "detail": f"this listener holds its maximum of {caps.served} connections; retry "
                  "later (/healthz and /readyz are still answered)"}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\n"
            f"Content-Type: {PROBLEM_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


@contextlib.contextmanager
def long_poll(request: BaseRequest) -> Iterator[None]:
    """Count a request its handler holds open against its listener's long-poll cap for the
    ``with`` block; :class:`Overloaded` (a 503 with ``Retry-After``) when the cap is full.
    A request that did not come through a guarded listener (an in-process test client) is
    not counted."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, _Guarded):
        yield
        return
    gate = guard.gate
    gate.hold()
    try:
        yield
    finally:
        gate.unhold()


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
    """One connection of a listener: aiohttp's request handler behind the listener's places
    and the read deadlines.

    A waiting connection has no handler yet: its bytes are kept until its request line
    (a probe's whole head) says where it goes, then handed to the handler it is given, or
    it is refused. The deadlines follow the request framing only as far as they need: the
    head ends at the first blank line, a ``Content-Length`` body is counted, and a chunked
    body (or anything it cannot frame) ends the deadlines for the rest of the connection
    (aiohttp still limits the body's size)."""

    def __init__(self, gate: _Gate, limits: ConnectionLimits,
                 handler: Callable[[], RequestHandler], kept: bytes = b"") -> None:
        self.gate = gate
        self.place: Place | None = None
        #: When it began to wait (the event loop's clock).
        self.since = 0.0
        #: The task connecting it (cancelled to refuse it before it is connected).
        self.task: asyncio.Task[None] | None = None
        self._limits = limits
        self._handler = handler
        self._inner: RequestHandler | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._connected = False
        self._state = "head"  # head | body | idle | untracked
        self._head = b""
        self._body_left = 0
        self._kept = kept  # bytes read before the connection was placed

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._connected = True
        self._transport = transport
        if self.place is None:  # refused while its TLS handshake or set-up ran
            transport.abort()
            return
        self._arm(self._limits.header_timeout_s)
        if self.place is not Place.WAITING:
            kept, self._kept = self._kept, b""
            self._serve(kept, one_request=self.place is Place.RESERVED)

    def data_received(self, data: bytes) -> None:
        if self.place is None:
            return
        if self._inner is None:
            self._sort(data)
            return
        self._frame(data)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            self._inner.eof_received()
        return None  # the transport closes (aiohttp's handler keeps nothing half-open)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.release(self)
        self._disarm()
        if self._connected and self._inner is not None:
            self._inner.connection_lost(exc)
        self._connected = False

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # --- places -----------------------------------------------------------------------

    def _sort(self, data: bytes) -> None:
        """A waiting connection's bytes: once its request line is in, serve it or refuse."""
        self._kept += data
        request = sort_request(self._kept)
        if request is Request.INCOMPLETE:
            if len(self._kept) > _MAX_WAITING_BYTES:
                self.refuse()
            return
        place = self.gate.place(self, request)
        if place is None:
            self.refuse()
            return
        kept, self._kept = self._kept, b""
        self._serve(kept, one_request=place is Place.RESERVED)

    def _serve(self, kept: bytes, *, one_request: bool) -> None:
        """Hand the connection (and the bytes already read) to a request handler; in a
        reserved slot it answers the one request and closes."""
        assert self._transport is not None
        inner = self._inner = self._handler()
        inner.connection_made(self._transport)
        if kept:
            self._frame(kept)
            inner.data_received(kept)
        if one_request:
            inner.close()  # no further request: the handler closes after this answer

    def refuse(self) -> None:
        """Past the cap: answer 503 and close (at once, for a peer that reads nothing)."""
        self.gate.release(self)
        self._disarm()
        transport = self._transport
        if transport is None:
            if self.task is not None:
                self.task.cancel()
            return
        if transport.is_closing():
            return
        transport.write(self.gate.refusal)
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

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
        if self.place is Place.WAITING:
            self.refuse()
        elif self._transport is not None and not self._transport.is_closing():
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
    """A listener (TCP or Unix socket) of an aiohttp runner, with its connection places and
    read deadlines; ``addresses`` are what it bound (the port is only known once started)."""

    __slots__ = ("_gate", "_limits", "_listener", "_sockets", "_tasks")

    def __init__(self, runner: web.BaseRunner, listener: Listener, *, caps: ListenerCaps,
                 limits: ConnectionLimits, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=_BACKLOG)
        self._listener = listener
        self._gate = _Gate(caps)
        self._limits = limits
        self._sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        if self._listener.path is not None:
            return f"unix:{self._listener.path}"
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._listener.host}:{self._listener.port}"

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
                # The kernel hands a connection over once its first bytes are in (or the
                # head's deadline passed): a socket that sends nothing takes no place here.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT,
                                int(self._limits.header_timeout_s))
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
        except OSError:
            for sock in bound:
                sock.close()
            raise
        return bound

    def _spawn(self, loop: asyncio.AbstractEventLoop, work: Any) -> asyncio.Task[None]:
        task = loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, listening: socket.socket) -> None:
        """Accept every connection and place it: what is queued, a turn of the event loop
        at a time (sock_accept alone would not yield while connections queue)."""
        loop = asyncio.get_running_loop()
        gate = self._gate
        while True:
            await gate.make_room()
            try:
                conn, _ = await loop.sock_accept(listening)
            except OSError as err:  # EMFILE and the like: back off rather than spin
                log.warning("accept failed", extra={"listener": self.name,
                                                    "error": err.strerror})
                await asyncio.sleep(0.5)
                continue
            self._place(loop, conn)
            for _ in range(_ACCEPTS_PER_TURN):
                if gate.full and gate.room_full:
                    break
                try:
                    conn, _ = listening.accept()
                except OSError:  # nothing queued (or EMFILE: the awaited accept reports it)
                    break
                self._place(loop, conn)
            await asyncio.sleep(0)

    def _place(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Place a connection just accepted. Past the cap, a plain connection's first bytes
        are read at once: most requests are in by now, and are refused (or a probe served)
        without waiting for another turn."""
        conn.setblocking(False)
        kept = b""
        if self._gate.full and self._ssl_context is None:
            try:
                kept = conn.recv(_MAX_WAITING_BYTES)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                conn.close()
                return
            else:
                if not kept:  # the peer is gone already
                    conn.close()
                    return
        request = sort_request(kept)
        guard = _Guarded(self._gate, self._limits, self._handler, kept)
        place = self._gate.place(guard, request)
        if place is None:
            with contextlib.suppress(OSError):
                conn.send(self._gate.refusal)
            conn.close()
            return
        guard.task = self._spawn(loop, self._connect(conn, guard))

    def _handler(self) -> RequestHandler:
        """A request handler with the runner's settings."""
        server = self._runner.server
        assert server is not None
        handler = server()
        # Same layout (no slots added), so the class can be swapped on what aiohttp made with
        # the runner's settings; aiohttp offers no handler class to configure.
        handler.__class__ = _ProblemHandler
        return handler

    async def _connect(self, conn: socket.socket, guard: _Guarded) -> None:
        loop = asyncio.get_running_loop()
        handshake = self._limits.header_timeout_s if self._ssl_context else None
        try:
            await loop.connect_accepted_socket(lambda: guard, conn, ssl=self._ssl_context,
                                               ssl_handshake_timeout=handshake)
        except (OSError, TimeoutError, asyncio.CancelledError):
            # A failed TLS handshake, a peer already gone, or refused before it connected.
            conn.close()
            self._gate.release(guard)

    async def stop(self) -> None:
        for sock in self._sockets:
            sock.close()
        for guard in list(self._gate.waiting):
            guard.refuse()
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
