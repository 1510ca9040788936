"""A real agent process: once a GPU lost to XID 79 is reset, a request waiting on
/v1/resourceslices gets the GPU's device without its taints within the 2 s republish goal."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent

URL = "/v1/resourceslices?kubernetes=1.35"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    running = start_agent(tmp_path / "state")
    yield running
    running.stop(signal.SIGKILL)


def _names(body: Any) -> set[str]:
    """The devices published untainted."""
    return {d["name"] for s in body["items"] for d in s["spec"].get("devices") or []
            if not d.get("taints")}


def _until(agent: AgentProcess, etag: str, done: Any, within_s: float) -> tuple[Any, float]:
    """Long-poll from ``etag`` until ``done(body)``; the body and the seconds it took."""
    started = time.monotonic()
    while True:
        left = within_s - (time.monotonic() - started)
        if left <= 0:
            return None, time.monotonic() - started
        reply = agent.request("GET", f"{URL}&wait_s={left:.2f}",
                              headers={"If-None-Match": etag})
        if reply.status == 200:
            etag = reply.headers["etag"]
            if done(reply.body):
                return reply.body, time.monotonic() - started


def test_a_reset_after_xid_79_wakes_a_waiting_request_with_the_gpu_within_2s(
        agent: AgentProcess) -> None:
    """After XID 79 taints GPU 5's device, POST /v1/sim/reset brings gpu-5 back untainted to
    a publisher already long-polling in under 2 s, as the XID itself tainted it."""
    first = agent.request("GET", URL)
    assert "gpu-5" in _names(first.body)
    assert agent.request("POST", "/v1/sim/xid", {"gpu": "5", "xid": 79}).status == 202
    gone, took = _until(agent, first.headers["etag"], lambda b: "gpu-5" not in _names(b), 5)
    assert gone is not None, f"gpu-5 still untainted {took:.1f} s after XID 79"
    etag = agent.request("GET", URL).headers["etag"]  # a fresh read: the GPU is lost in it
    held = agent.send("GET", f"{URL}&wait_s=12", headers={"If-None-Match": etag})
    reset = time.monotonic()
    assert agent.request("POST", "/v1/sim/reset", {"gpu": "5"}).status == 204
    reply = held.reply()
    assert reply.status == 200, "the held request was not woken by the reset"
    back = reply.body if "gpu-5" in _names(reply.body) else \
        _until(agent, reply.headers["etag"], lambda b: "gpu-5" in _names(b), 12)[0]
    took = time.monotonic() - reset
    assert back is not None and took < 2.0, \
        f"gpu-5 untainted {took:.1f} s after the reset (goal 2 s)"
