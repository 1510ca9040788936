"""Hostile peers on the sockets (issue 13, item 6): a flood of slow sockets on the metrics
listener, under the 1,024-descriptor limit a systemd unit gets by default, leaves ``/healthz``
answered on the other listeners; slow, idle and trickling connections are closed on time."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.api.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, IDLE_TIMEOUT_S
from tests.agent_process import AgentProcess, start_agent
from tests.reliability.peers import Flood, soft_fd_limit, tcp_address
from tests.waiting import wait_for

FD_LIMIT = 1024
SOCKETS = 1000
FLOOD_S = 12.0
PROBE_EVERY_S = 0.05
#: Half of a kubelet probe's default 1 s timeout: what a liveness probe needs. The failure
#: this guards against (descriptors exhausted, probes stuck in the accept queue) is probes
#: timing out; tighter figures are a matter for a benchmark, since under the full test tier
#: on 2 shared cores the p99 reached 115 ms with the agent behaving (docs/reliability.md).
P99_BOUND_S = 0.5


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    with soft_fd_limit(FD_LIMIT):
        agent = start_agent(tmp_path_factory.mktemp("flood") / "state",
                            extra=["--metrics-listen", "127.0.0.1:0"])
    limits = Path(f"/proc/{agent.proc.pid}/limits").read_text()
    assert any(line.startswith("Max open files") and f" {FD_LIMIT} " in line
               for line in limits.splitlines()), limits
    yield agent
    agent.stop(signal.SIGKILL)


def _probe(agent: AgentProcess, address: tuple[str, int] | None = None) -> float:
    """Seconds a fresh connection's GET /healthz took on the main TCP listener (or
    ``address``); 2 s when it failed or timed out."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection(*(address or agent.address), timeout=2)
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        ok = response.status == 200
    except OSError:
        ok = False
    finally:
        conn.close()
    return time.perf_counter() - started if ok else 2.0


def test_healthz_stays_fast_while_the_metrics_port_is_flooded(limited: AgentProcess) -> None:
    """1,000 slow sockets on --metrics-listen (agent limited to 1,024 descriptors) for 12 s:
    /healthz on the main listener answers every probe, within 0.5 s at p99, and on the
    flooded listener too (issue 22: in a reserved slot); the metrics listener holds no more
    than its cap and the agent never runs out of descriptors."""
    flood = Flood(tcp_address(limited.listener("metrics")), SOCKETS)
    flooder = threading.Thread(target=flood.run, daemon=True)
    flooder.start()
    latencies: list[float] = []
    most_fds = 0
    unix_ok = 0
    flooded: list[float] = []
    metrics = tcp_address(limited.listener("metrics"))
    try:
        wait_for(lambda: flood.most_open >= SOCKETS * 0.9, "the flood to reach its sockets")
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            latencies.append(_probe(limited))
            most_fds = max(most_fds, len(os.listdir(f"/proc/{limited.proc.pid}/fd")))
            if len(latencies) % 20 == 0:
                unix_ok += limited.request("GET", "/healthz", token=None, unix=True).status == 200
                flooded.append(_probe(limited, metrics))
            time.sleep(PROBE_EVERY_S)
    finally:
        flood.stop.set()
        flooder.join(10)
    latencies.sort()
    p99 = latencies[max(0, int(len(latencies) * 0.99) - 1)]
    print(f"flood: {flood.opened} sockets opened, at most {flood.most_open} at once, "
          f"{flood.closed_by_server} closed by the agent; /healthz {len(latencies)} probes, p50 "
          f"{statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
          f"{latencies[-1] * 1000:.1f} ms; agent at most {most_fds} descriptors")
    assert flood.most_open >= SOCKETS * 0.9
    assert latencies[-1] < 2.0, "a /healthz probe failed or timed out"
    assert p99 <= P99_BOUND_S, latencies[-10:]
    assert unix_ok == len(latencies) // 20
    print(f"/healthz on the flooded listener: {len(flooded)} probes, max "
          f"{max(flooded) * 1000:.1f} ms")
    assert max(flooded) < 2.0, "a /healthz probe on the flooded listener failed"
    # The metrics listener holds its 64 descriptors and answers the rest 503 at once.
    assert most_fds < FD_LIMIT // 2, most_fds
    assert limited.request("GET", "/readyz", token=None).status == 200


def _closed_after(address: tuple[str, int], *, send: bytes, trickle: bool,
                  limit_s: float) -> float:
    """Seconds until the server closes a connection that sent ``send`` (then, if
    ``trickle``, a byte a second), reading any reply; ``limit_s`` if it never does."""
    sock = socket.create_connection(address, timeout=1)
    started = time.monotonic()
    try:
        sock.sendall(send)
        while time.monotonic() - started < limit_s:
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - started
            except TimeoutError:
                if trickle:
                    try:
                        sock.send(b"x")
                    except OSError:
                        return time.monotonic() - started
            except OSError:
                return time.monotonic() - started
        return limit_s
    finally:
        sock.close()


@pytest.mark.slow
def test_slow_idle_and_trickling_connections_are_closed_on_time(limited: AgentProcess) -> None:
    """A request head trickled a byte a second is cut at the header timeout, a body
    trickled likewise at the body timeout, an idle keep-alive connection at the idle
    timeout, and a request being answered is not cut at all."""
    address = limited.address
    cases = {
        "head": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", True, HEADER_TIMEOUT_S),
        "body": (b"PUT /v1/claims/slow HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100000\r\n\r\n{", True, BODY_TIMEOUT_S),
        "idle": (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", False, IDLE_TIMEOUT_S),
    }
    results: dict[str, float] = {}

    def measure(name: str, send: bytes, trickle: bool, expected: float) -> None:
        results[name] = _closed_after(address, send=send, trickle=trickle,
                                      limit_s=expected + 10)

    threads = [threading.Thread(target=measure, args=(name, *case))
               for name, case in cases.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BODY_TIMEOUT_S + 20)
    for name, (_, _, expected) in cases.items():
        assert expected - 1 <= results[name] <= expected + 3, (name, results)
    # A request with its body sent in full is answered however long it takes to send.
    reply = limited.request("GET", "/v1/node", token=None)
    assert reply.status == 200
