"""Hostile and busy peers of a real agent's listeners, each run in a thread of the test
process: slow sockets (:class:`Flood`), long-polls (:class:`LongPolls`), and the probes that
must still be answered meanwhile (:func:`probe_for`)."""

from __future__ import annotations

import contextlib
import errno
import http.client
import math
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.agent_process import AgentProcess

#: A TCP ``(host, port)`` or a Unix socket's path.
Address = tuple[str, int] | Path
#: Seconds a failed or unanswered probe is recorded as.
FAILED = math.inf


@contextlib.contextmanager
def soft_fd_limit(limit: int) -> Iterator[None]:
    """Lower this process's soft RLIMIT_NOFILE while a child is started (it inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def tcp_address(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def _open(address: Address) -> socket.socket | None:
    """A non-blocking socket connecting to ``address``; None when the connect failed at once
    (a Unix socket's backlog full, say)."""
    family = socket.AF_UNIX if isinstance(address, Path) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    err = sock.connect_ex(str(address) if isinstance(address, Path) else address)
    if err not in (0, errno.EINPROGRESS):
        sock.close()
        return None
    return sock


@dataclass
class Flood:
    """``sockets`` slow sockets held open against one address: each sends a partial request
    head and then a byte a second; one the server closes is opened again 0.2 s later."""

    address: Address
    sockets: int = 1000
    stop: threading.Event = field(default_factory=threading.Event)
    opened: int = 0
    closed_by_server: int = 0
    most_open: int = 0

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        live: dict[socket.socket, float] = {}
        due: list[float] = [0.0] * self.sockets
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                while due and due[0] <= now and len(live) < self.sockets:
                    due.pop(0)
                    sock = _open(self.address)
                    if sock is None:
                        due.append(now + 0.2)
                        continue
                    selector.register(sock, selectors.EVENT_WRITE)
                    live[sock] = now
                    self.opened += 1
                self.most_open = max(self.most_open, len(live))
                for key, events in selector.select(timeout=0.05):
                    sock = key.fileobj  # type: ignore[assignment]
                    assert isinstance(sock, socket.socket)
                    if events & selectors.EVENT_WRITE:
                        try:
                            sock.send(b"GET /metrics HTTP/1.1\r\nHost: flood\r\nX-Slow: ")
                        except OSError:
                            self._drop(selector, live, due, sock)
                            continue
                        selector.modify(sock, selectors.EVENT_READ)
                        continue
                    with contextlib.suppress(OSError):
                        sock.recv(4096)
                    self.closed_by_server += 1
                    self._drop(selector, live, due, sock)
                for sock, last in list(live.items()):
                    if now - last >= 1.0:
                        live[sock] = now
                        with contextlib.suppress(OSError):
                            sock.send(b"x")
        finally:
            for sock in live:
                sock.close()
            selector.close()

    def _drop(self, selector: selectors.BaseSelector, live: dict[socket.socket, float],
              due: list[float], sock: socket.socket) -> None:
        selector.unregister(sock)
        live.pop(sock, None)
        sock.close()
        due.append(time.monotonic() + 0.2)


@dataclass
class _Poll:
    """One long-poll's connection: what it sent and what came back so far."""

    address: Address
    sent: bool = False
    got: bytes = b""


def whole_answer(got: bytes) -> tuple[int, dict[str, str]] | None:
    """The status and headers of a whole answer in ``got``; None while it is not whole."""
    end = got.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = got[:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if len(got) - end - 4 < int(headers.get("content-length", "0")):
        return None
    return int(lines[0].split(" ")[1]), headers


@dataclass
class LongPolls:
    """``per_address`` long-polls held against each address: ``GET /v1/resourceslices`` with
    the current ETag and ``wait_s``, each on a connection of its own. Every answer is read
    whole and counted by status (a 503 without ``Retry-After`` counted apart); the poll is
    then sent again on a fresh connection, after the ``Retry-After`` of a 503. A connection
    reset before a single byte of an answer came is ``reset`` (the kernel resets one that
    the agent never took as well); one that ends otherwise without a whole answer (closed, or
    reset part-way) is ``lost``. Once ``stop`` is set no poll is sent again,
    and :meth:`run` returns when every poll sent has ended (or after ``drain_s``)."""

    addresses: list[Address]
    per_address: int
    etag: str
    wait_s: float
    token: str | None = None
    drain_s: float = 30.0
    stop: threading.Event = field(default_factory=threading.Event)
    answers: Counter[int] = field(default_factory=Counter)
    without_retry_after: int = 0
    sent: int = 0
    lost: int = 0
    reset: int = 0
    not_connected: int = 0
    most_open: int = 0

    def request(self) -> bytes:
        auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
        return (f"GET /v1/resourceslices?wait_s={self.wait_s:g} HTTP/1.1\r\nHost: poll\r\n"
                f"If-None-Match: {self.etag}\r\n{auth}\r\n").encode()

    def run(self) -> None:
        request = self.request()
        selector = selectors.DefaultSelector()
        open_polls: dict[socket.socket, _Poll] = {}
        due: list[tuple[float, Address]] = [(0.0, a) for a in self.addresses
                                             for _ in range(self.per_address)]
        drain_until = math.inf
        try:
            while open_polls or (due and not self.stop.is_set()):
                now = time.monotonic()
                if self.stop.is_set():
                    drain_until = min(drain_until, now + self.drain_s)
                    if now > drain_until:
                        break
                else:
                    due.sort(key=lambda d: d[0])
                    while due and due[0][0] <= now:
                        _, address = due.pop(0)
                        sock = _open(address)
                        if sock is None:
                            self.not_connected += 1
                            due.append((now + 0.2, address))
                            continue
                        open_polls[sock] = _Poll(address)
                        selector.register(sock, selectors.EVENT_WRITE)
                self.most_open = max(self.most_open, len(open_polls))
                for key, _ in selector.select(timeout=0.05):
                    sock = key.fileobj  # type: ignore[assignment]
                    assert isinstance(sock, socket.socket)
                    poll = open_polls[sock]
                    again = self._step(sock, poll, request, selector)
                    if again is None:
                        continue
                    selector.unregister(sock)
                    sock.close()
                    del open_polls[sock]
                    due.append((time.monotonic() + again, poll.address))
        finally:
            for sock in open_polls:
                sock.close()
            selector.close()

    def _step(self, sock: socket.socket, poll: _Poll, request: bytes,
              selector: selectors.BaseSelector) -> float | None:
        """Advance one poll; the seconds until it is sent again once it ended, else None."""
        if not poll.sent:
            try:
                sock.send(request)
            except OSError:  # the connect failed: never reached the agent
                self.not_connected += 1
                return 0.2
            poll.sent = True
            self.sent += 1
            selector.modify(sock, selectors.EVENT_READ)
            return None
        reset = False
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
            reset = True
        poll.got += chunk
        answer = whole_answer(poll.got)
        if answer is None:
            if chunk:
                return None
            if reset and not poll.got:
                self.reset += 1
            else:
                self.lost += 1  # closed, or reset part-way, before a whole answer
            return 0.2
        status, headers = answer
        self.answers[status] += 1
        if status == 503:
            if "retry-after" not in headers:
                self.without_retry_after += 1
            return float(headers.get("retry-after", "1"))
        return 0.0


def probe(agent: AgentProcess, *, unix: bool, timeout_s: float = 5.0,
          failures: list[str] | None = None) -> float:
    """Seconds a fresh connection's ``GET /healthz`` took on the agent's TCP listener or its
    Unix socket; :data:`FAILED` when it failed or timed out (and why, in ``failures``)."""
    started = time.perf_counter()
    try:
        if unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(str(agent.socket_path))
            conn = http.client.HTTPConnection("localhost", timeout=timeout_s)
            conn.sock = sock
        else:
            conn = http.client.HTTPConnection(*agent.address, timeout=timeout_s)
        try:
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        failed = "" if response.status == 200 else f"{response.status} {body[:200]!r}"
    except OSError as err:
        failed = repr(err)
    if failed and failures is not None:
        failures.append(f"{'unix' if unix else 'tcp'} after "
                        f"{time.perf_counter() - started:.3f} s: {failed}")
    return FAILED if failed else time.perf_counter() - started


def probe_for(agent: AgentProcess, seconds: float, *, every_s: float = 0.05,
              unix_every: int = 1, failures: list[str] | None = None,
              between: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Probe ``/healthz`` on the TCP listener every ``every_s`` for ``seconds`` (and on the
    Unix socket every ``unix_every``-th time), calling ``between`` after each; each
    listener's latencies (why any failed in ``failures``)."""
    found: dict[str, list[float]] = {"tcp": [], "unix": []}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found["tcp"].append(probe(agent, unix=False, failures=failures))
        if len(found["tcp"]) % unix_every == 0:
            found["unix"].append(probe(agent, unix=True, failures=failures))
        if between is not None:
            between()
        time.sleep(every_s)
    return found


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * share) - 1)]
