"""The listeners' decisions, as values (issue 22, item 7): what a connection past the cap asks
for from its first bytes, and how a descriptor budget is split between a listener's places.
The behaviour on real sockets is in tests/reliability/test_probes.py."""

from __future__ import annotations

import resource

import pytest

from agent.api.connections import (
    RESERVED_FDS,
    ConnectionLimits,
    ListenerCaps,
    Request,
    sort_request,
)
from tests.reliability.peers import soft_fd_limit

HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(("kept", "request_"), [
    (b"", Request.INCOMPLETE),
    (b"GET /healthz HTTP/1.1", Request.INCOMPLETE),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", Request.INCOMPLETE),
    (HEAD, Request.PROBE),
    (b"GET /readyz HTTP/1.1\r\n\r\n", Request.PROBE),
    (b"HEAD /healthz HTTP/1.0\r\n\r\n", Request.PROBE),
    (b"GET /healthz?verbose=1 HTTP/1.1\r\n\r\n", Request.PROBE),
    (b"GET /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", Request.PROBE),
    (HEAD + b"GET /v1/node HTTP/1.1\r\n\r\n", Request.PROBE),  # a pipelined second request
    (b"GET /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", Request.OTHER),
    (b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", Request.OTHER),
    (b"POST /healthz HTTP/1.1\r\n\r\n", Request.OTHER),
    (b"get /healthz HTTP/1.1\r\n\r\n", Request.OTHER),
    (b"GET /healthzz HTTP/1.1\r\n\r\n", Request.OTHER),
    (b"GET /v1/healthz HTTP/1.1\r\n\r\n", Request.OTHER),
    (b"GET  /healthz HTTP/1.1\r\n\r\n", Request.OTHER),
    (b"GET /v1/node HTTP/1.1\r\n", Request.OTHER),  # refused before its headers
    (b"GET /metrics HTTP/1.1\r\nHost: flood\r\nX-Slow: ", Request.OTHER),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", Request.INCOMPLETE),  # TLS, unread
])
def test_a_connection_past_the_cap_is_sorted_by_its_first_bytes(kept: bytes,
                                                                 request_: Request) -> None:
    assert sort_request(kept) is request_


@pytest.mark.parametrize("descriptors", [4, 16, 32, 64, 208, 224, 1024])
def test_a_listeners_places_fit_its_descriptors(descriptors: int) -> None:
    """Every place has room (a probe always has a reserved slot), long-polls never take more
    than half the served slots, and the places together take no more descriptors than the
    listener has (past the smallest budgets, where each place keeps its minimum)."""
    caps = ListenerCaps.within(descriptors)
    assert caps.served >= 2 and caps.waiting >= 2 and caps.reserved >= 1
    assert 1 <= caps.long_polls <= max(1, caps.served // 2)
    assert caps.descriptors <= max(descriptors, 5)


@pytest.mark.parametrize(("limit", "api"), [
    (256, ListenerCaps(served=24, waiting=3, reserved=1, long_polls=12)),  # of 28
    (1024, ListenerCaps(served=178, waiting=26, reserved=4, long_polls=89)),  # of 208
    (8192, ListenerCaps(served=892, waiting=128, reserved=4, long_polls=446)),  # of 1,024
])
def test_the_caps_follow_the_descriptor_limit(limit: int, api: ListenerCaps) -> None:
    """With two API listeners and the metrics listener: the API listeners' places as the
    limit gives them, and all listeners together within the descriptors not kept for the
    rest of the agent."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < limit:
        pytest.skip(f"the hard descriptor limit is under {limit}")
    with soft_fd_limit(limit):
        limits = ConnectionLimits.for_process(2, metrics=True)
    assert limits.api == api
    assert 2 * limits.api.descriptors + limits.metrics.descriptors <= limit - RESERVED_FDS
