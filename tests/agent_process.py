"""Starting and talking to a real ``gpu-agent serve`` process: integration tests, the harnesses
and the benchmarks use the same one."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.waiting import wait_for


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0]


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(self._path))


def exchange(conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None,
             headers: dict[str, str]) -> Reply:
    """Send one request on ``conn`` (then closed) and read the reply, JSON bodies parsed."""
    try:
        conn.request(method, path, body=data, headers=headers)
    except BaseException:
        conn.close()
        raise
    return receive(conn)


def receive(conn: http.client.HTTPConnection) -> Reply:
    """The reply to the request sent on ``conn`` (then closed), JSON bodies parsed."""
    try:
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    out = {k.lower(): v for k, v in response.getheaders()}
    parsed: Any = payload.decode(errors="replace")
    if payload and out.get("content-type", "").split(";")[0].endswith("json"):
        parsed = json.loads(payload)
    return Reply(response.status, out, parsed)


def _queues(local_port: int, remote_port: int) -> tuple[int, int] | None:
    """The (unsent or unacknowledged, unread) bytes of the loopback TCP socket from
    ``local_port`` to ``remote_port``, from /proc/net/tcp; None if there is none."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == local_port \
                and int(fields[2].rsplit(":", 1)[1], 16) == remote_port:
            tx, rx = fields[4].split(":")
            return int(tx, 16), int(rx, 16)
    return None


@dataclass
class Pending:
    """A request sent on a connection of its own whose reply is read later: a long-poll a
    test holds open while it changes something."""

    conn: http.client.HTTPConnection
    agent_port: int

    def read_by_agent(self) -> bool:
        """Whether the agent has read the whole request: the client has nothing unsent or
        unacknowledged, and the agent's side of the connection nothing unread."""
        mine = self.conn.sock.getsockname()[1]
        client, agent = _queues(mine, self.agent_port), _queues(self.agent_port, mine)
        return client is not None and agent is not None and client[0] == 0 and agent[1] == 0

    def reply(self) -> Reply:
        """The reply (blocking until it came), the connection closed."""
        return receive(self.conn)


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path
    url: str = ""
    token: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "agent.sock"

    @property
    def address(self) -> tuple[str, int]:
        """Host and port of the TCP listener."""
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        return host, int(port)

    def listener(self, kind: str) -> str:
        """The first address the agent wrote in ``listeners.json`` under ``kind`` (e.g.
        ``"metrics"`` for ``--metrics-listen``)."""
        return str(json.loads((self.state_dir / "listeners.json").read_text())[kind][0])

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = "auto",
                unix: bool = False, raw: bytes | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        """One HTTP request; ``token="auto"`` sends the agent's token, ``None`` sends none."""
        sent = dict(headers or {})
        if token == "auto":
            token = self.token
        if token:
            sent["Authorization"] = f"Bearer {token}"
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        if unix:
            conn: http.client.HTTPConnection = _Unix(self.socket_path)
        else:
            conn = http.client.HTTPConnection(*self.address, timeout=30)
        return exchange(conn, method, path, data, sent)

    def send(self, method: str, path: str, body: Any = None, *,
             headers: dict[str, str] | None = None) -> Pending:
        """A request sent over TCP, its reply read later (:meth:`Pending.reply`); it returns
        once the agent has read the whole request (its handler is running)."""
        sent = dict(headers or {})
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection(*self.address, timeout=30)
        try:
            conn.request(method, path, body=data, headers=sent)
            pending = Pending(conn, self.address[1])
            wait_for(pending.read_by_agent, f"the agent to read {method} {path}", 10,
                     every_s=0.005)
        except BaseException:
            conn.close()
            raise
        return pending

    def poll(self, path: str, until: Callable[[Any], bool], interval: float = 0.002,
             timeout: float = 300) -> Any:
        """GET ``path`` until ``until(body)`` holds; that body. The interval is short: the
        benchmarks time what they poll for."""
        def holds() -> list[Any]:
            body = self.request("GET", path).body
            return [body] if until(body) else []
        return wait_for(holds, f"GET {path} to answer as wanted", timeout,
                        every_s=interval)[0]

    def wait_ready(self, timeout: float = 30) -> None:
        def ready() -> bool:
            self._check_alive()
            try:
                return self.request("GET", "/readyz", token=None).status == 200
            except OSError:
                return False  # not accepting (yet, or any more): the liveness check says which
        try:
            wait_for(ready, "/readyz to answer 200", timeout, every_s=0.05)
        except AssertionError as err:
            if self.proc.poll() is not None:
                raise  # it exited: _check_alive's message has the log
            raise AssertionError(f"{err}; agent not ready:\n{self.log()}") from None

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_agent(state_dir: Path, *, preset: str | None = "dgx-h100", extra: list[str] | None = None,
                env: dict[str, str] | None = None, wait_ready: bool = True) -> AgentProcess:
    """Start ``python -m agent serve`` on an ephemeral port and the state dir's socket."""
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "agent", "serve", "--state-dir", str(state_dir),
            "--listen", "127.0.0.1:0", "--listen", f"unix:{state_dir / 'agent.sock'}",
            *(["--simulate", preset] if preset else []), *(extra or [])]
    log_path = state_dir.parent / f"{state_dir.name}.log"
    listeners = state_dir / "listeners.json"
    listeners.unlink(missing_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    agent = AgentProcess(proc, state_dir, log_path, args=args)
    def listening() -> bool:
        agent._check_alive()
        return listeners.exists()
    try:
        wait_for(listening, f"{listeners} (the agent listening)", 30)
    except AssertionError as err:
        if agent.proc.poll() is not None:
            raise  # it exited: _check_alive's message has the log
        agent.stop(signal.SIGKILL)
        raise AssertionError(f"{err}:\n{agent.log()}") from None
    bound = json.loads(listeners.read_text())["listeners"]
    agent.url = next(u for u in bound if u.startswith(("http://", "https://")))
    tokens = state_dir / "tokens"
    if tokens.exists():
        agent.token = tokens.read_text().split(":")[1].strip()
    if wait_ready:
        agent.wait_ready()
    return agent


def kill_daemons_of(state_dir: Path) -> list[int]:
    """SIGKILL every process whose command line names a path under ``state_dir``: what an
    agent started there to outlive it (its simulated IMEX daemon, MPS control daemons), once
    the test that ran it is over. The pids killed."""
    marker = str(state_dir).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed
