"""The plugin's HTTP/1.1 client of the agent's Unix socket (agent/kubeplugin/agent_http.py)
against a scripted server: how answers are framed, connections reused, and a connection the
server closed while idle replaced."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from agent.kubeplugin.agent_http import UnixHttp

Answer = Callable[[int], bytes]  # the raw answer to the n-th request of a connection


class Scripted:
    """A Unix socket server answering each request with ``answer(n)`` (n counts from 0 per
    connection) and closing the connection after ``close_after`` answers (None: never)."""

    def __init__(self, path: Path, answer: Answer, close_after: int | None = None) -> None:
        self.path = path
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while self.close_after is None or n < self.close_after:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.answer(n))
                await writer.drain()
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Scripted]]]:
    started: list[Scripted] = []
    with tempfile.TemporaryDirectory(prefix="ahttp-", dir="/tmp") as tmp:

        async def make(answer: Answer, close_after: int | None = None) -> Scripted:
            server = Scripted(Path(tmp) / f"s{len(started)}.sock", answer, close_after)
            await server.start()
            started.append(server)
            return server

        yield make
        for server in started:
            await server.stop()


def ok(body: bytes = b'{"ok":true}') -> Answer:
    return lambda n: (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def test_answers_reuse_one_connection(serve: Callable[..., Awaitable[Scripted]]) -> None:
    """Three requests one after another travel on one keep-alive connection; each gets its
    status, headers and body, and the request carries the JSON body and the query."""
    server = await serve(ok())
    http = UnixHttp(str(server.path))
    try:
        for i in range(3):
            answer = await http.request("PUT", "/v1/claims/a", body={"i": i},
                                        params={"issued_at_ns": "7"})
            assert (answer.status, answer.body) == (200, b'{"ok":true}')
            assert answer.headers["content-type"] == "application/json"
    finally:
        http.close()
    assert server.connections == 1
    assert server.requests[2].startswith(b"PUT /v1/claims/a?issued_at_ns=7 HTTP/1.1\r\n")
    assert server.requests[2].endswith(b'\r\n\r\n{"i": 2}')


async def test_a_connection_closed_while_idle_is_replaced(
        serve: Callable[..., Awaitable[Scripted]]) -> None:
    """The server closes each connection after one answer (as the agent does past its
    keep-alive timeout): every request still gets its answer, each on a new connection."""
    server = await serve(ok(), close_after=1)
    http = UnixHttp(str(server.path))
    try:
        for _ in range(3):
            assert (await http.request("GET", "/readyz")).status == 200
    finally:
        http.close()
    assert server.connections == 3


async def test_a_chunked_answer_is_read_whole(serve: Callable[..., Awaitable[Scripted]]) -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4\r\n{\"a\"\r\n5;x=y\r\n:[1]}\r\n0\r\n\r\n")
    server = await serve(lambda n: chunked)
    http = UnixHttp(str(server.path))
    try:
        first = await http.request("GET", "/v1/resourceslices")
        second = await http.request("GET", "/v1/resourceslices")
    finally:
        http.close()
    assert first.body == second.body == b'{"a":[1]}'
    assert server.connections == 1


async def test_no_content_and_not_modified_have_no_body(
        serve: Callable[..., Awaitable[Scripted]]) -> None:
    answers = [b"HTTP/1.1 204 No Content\r\n\r\n",
               b'HTTP/1.1 304 Not Modified\r\nETag: "3"\r\n\r\n']
    server = await serve(lambda n: answers[n])
    http = UnixHttp(str(server.path))
    try:
        deleted = await http.request("DELETE", "/v1/claims/a")
        unchanged = await http.request("GET", "/v1/resourceslices",
                                       headers={"If-None-Match": '"3"'})
    finally:
        http.close()
    assert (deleted.status, deleted.body) == (204, b"")
    assert (unchanged.status, unchanged.body, unchanged.headers["etag"]) == (304, b"", '"3"')


async def test_an_answer_cut_short_is_an_error(serve: Callable[..., Awaitable[Scripted]]) -> None:
    """A body shorter than its Content-Length when the server closes is an ``OSError`` (the
    agent unreachable, to the plugin), never a truncated answer."""
    server = await serve(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\"",
                         close_after=1)
    http = UnixHttp(str(server.path))
    try:
        with pytest.raises(OSError, match="mid-answer"):
            await http.request("GET", "/v1/claims")
    finally:
        http.close()


async def test_nothing_listening_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        await UnixHttp(str(tmp_path / "none.sock")).request("GET", "/readyz")
