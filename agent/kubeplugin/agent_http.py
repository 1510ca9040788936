"""HTTP/1.1 to the agent over its Unix socket: keep-alive connections, one request at a time
each, answers framed by ``Content-Length`` or chunked encoding.

The plugin makes two calls per claim (prepare, unprepare) to the one server it knows, on a
socket only that server listens on; a general client (aiohttp's, with its URL handling,
cookies, tracing and per-request tasks) cost more CPU per call than the rest of the plugin's
work on a claim. This one writes the request in one call and parses the answer as it comes.

A connection the agent closed while idle (its keep-alive timeout) is noticed before reuse;
one it closes just as a request goes out fails that request with nothing answered, and the
request is sent once more on a new connection (every call the plugin makes is idempotent).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from multidict import CIMultiDict

#: Most bytes of a status line and headers (the agent's are a few hundred).
MAX_HEAD_BYTES = 64 * 1024
_NO_BODY = frozenset({204, 304})


class ProtocolError(OSError):
    """The agent's answer is not HTTP/1.1 this client can read."""


class _Closed(ConnectionResetError):
    """The connection closed before any byte of the answer (safe to send again)."""


@dataclass(frozen=True)
class Answer:
    """One response: status, headers (case-insensitive) and the body's bytes."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; :meth:`exchange` sends a request and waits for its answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Answer] | None = None
        self._got_bytes = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._buffer += data
        if self._waiter is not None and not self._waiter.done():
            try:
                answer = self._parse(eof=False)
            except ProtocolError as err:
                self._fail(err)
                return
            if answer is not None:
                self._waiter.set_result(answer)

    def eof_received(self) -> bool:
        self._lost(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    # one request at a time
    async def exchange(self, request: bytes) -> Answer:
        """Send ``request`` (whole, head and body) and wait for the answer."""
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._got_bytes = False
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _lost(self, exc: Exception | None) -> None:
        first = not self.closed
        self.closed = True
        self.reusable = False
        if self._waiter is None or self._waiter.done():
            return
        if not first:
            return
        try:
            answer = self._parse(eof=True)  # an answer framed by the end of the connection
        except ProtocolError as err:
            self._fail(err)
            return
        if answer is not None:
            self._waiter.set_result(answer)
        elif not self._got_bytes:
            self._fail(_Closed(str(exc) if exc else "the agent closed the connection"))
        else:
            self._fail(ProtocolError("the agent closed the connection mid-answer"))

    def _fail(self, err: Exception) -> None:
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(err)
        if self.transport is not None:
            self.transport.close()

    def _parse(self, *, eof: bool) -> Answer | None:
        """The answer, once the buffer holds all of it; None until then."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise ProtocolError("the agent's answer has no end of headers")
            return None
        lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(code)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"a header line without ':': {line[:80]!r}")
            headers.add(name.strip(), value.strip())
        start = end + 4
        connection = headers.get("Connection", "").lower()
        if status in _NO_BODY or 100 <= status < 200:
            body: bytes | None = b""
            taken = start
        elif "chunked" in headers.get("Transfer-Encoding", "").lower():
            body, taken = _dechunk(buffer, start)
        elif "Content-Length" in headers:
            length = headers["Content-Length"]
            if not length.isdigit():
                raise ProtocolError(f"Content-Length {length[:40]!r}")
            taken = start + int(length)
            body = bytes(buffer[start:taken]) if len(buffer) >= taken else None
        else:  # framed by the end of the connection
            self.reusable = False
            body, taken = (bytes(buffer[start:]), len(buffer)) if eof else (None, 0)
        if body is None:
            if eof:
                raise ProtocolError("the agent closed the connection mid-answer")
            return None
        del buffer[:taken]
        if connection == "close" or buffer:
            self.reusable = False  # closing, or bytes nobody asked for
        return Answer(status, headers, body)


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes | None, int]:
    """A chunked body from ``start``: (the body, where it ends), or (None, 0) until all of it
    has arrived."""
    parts: list[bytes] = []
    at = start
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None, 0
        size_text = bytes(buffer[at:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ProtocolError(f"chunk size {size_text[:20]!r}") from None
        at = line_end + 2
        if size == 0:
            # Trailers, if any, then the blank line.
            while True:
                line_end = buffer.find(b"\r\n", at)
                if line_end < 0:
                    return None, 0
                blank = line_end == at
                at = line_end + 2
                if blank:
                    return b"".join(parts), at
        if len(buffer) < at + size + 2:
            return None, 0
        parts.append(bytes(buffer[at:at + size]))
        at += size + 2


class UnixHttp:
    """Requests to the server on Unix socket ``path``, over at most ``limit`` connections at
    once (calls beyond wait for one). Bound to the event loop of its first call; opened
    lazily, so it may be made outside the loop."""

    def __init__(self, path: str, *, host: str = "gpu-agent", limit: int = 256) -> None:
        self.path = path
        self._host = host
        self._limit = limit
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def request(self, method: str, target: str, *, body: Any = None,
                      params: Mapping[str, str] | None = None,
                      headers: Mapping[str, str] | None = None,
                      connect_timeout_s: float = 5.0) -> Answer:
        """One request; ``body`` is sent as JSON. ``OSError`` (``ConnectionError``,
        :class:`ProtocolError`, ...) when there is no answer; the caller bounds the time."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that made them
            self._idle, self._loop = [], loop
            self._slots = asyncio.Semaphore(self._limit)
        assert self._slots is not None
        self._closed = False
        payload = b"" if body is None else json.dumps(body).encode()
        if params:
            target = f"{target}?{urlencode(params)}"
        head = [f"{method} {target} HTTP/1.1", f"Host: {self._host}",
                f"Content-Length: {len(payload)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload
        async with self._slots:
            while True:
                connection, reused = await self._connection(connect_timeout_s)
                try:
                    answer = await connection.exchange(message)
                except _Closed:
                    connection.close()
                    if reused:
                        continue  # closed by the agent while idle: once more, on a new one
                    raise
                except BaseException:
                    connection.close()  # cancelled or failed mid-answer: its state is unknown
                    raise
                if connection.reusable and not connection.closed and not self._closed:
                    self._idle.append(connection)
                else:
                    connection.close()
                return answer

    async def _connection(self, connect_timeout_s: float) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and connection.transport is not None \
                    and not connection.transport.is_closing():
                return connection, True
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout_s):
            _, protocol = await loop.create_unix_connection(_Connection, self.path)
        return protocol, False

    def close(self) -> None:
        """Close the idle connections, and those in use once their answer is in (a later
        request opens new ones)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
