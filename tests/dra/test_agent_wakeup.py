"""A real agent process: a request waiting on /v1/resourceslices wakes within 2 s of a
geometry change (the republish goal) and of an XID, with the new slices."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, Pending, start_agent

URL = "/v1/resourceslices?kubernetes=1.35"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    running = start_agent(tmp_path / "state", extra=["--dynamic-mig"])
    yield running
    running.stop(signal.SIGKILL)


def _names(body: Any) -> set[str]:
    return {d["name"] for s in body["items"] for d in s["spec"].get("devices") or []}


def _held(agent: AgentProcess, etag: str) -> Pending:
    """A long-poll from ``etag`` the agent has read (and is holding: nothing changed)."""
    return agent.send("GET", f"{URL}&wait_s=20", headers={"If-None-Match": etag})


def _gpu0(body: Any) -> set[str]:
    return {n for n in _names(body) if n == "gpu-0" or n.startswith("gpu-0-")}


def _xid_tainted(body: Any) -> bool:
    """Every device of GPU 0 still published, each tainted with XID 79."""
    own = [d for s in body["items"] for d in s["spec"].get("devices") or []
           if d["name"] == "gpu-0" or d["name"].startswith("gpu-0-")]
    return bool(own) and all(
        {"key": "gpu.nodeagent.dev/xid", "value": "79"}.items()
        <= t.items() for d in own for t in d.get("taints") or [] if t["key"].endswith("/xid")
    ) and all(any(t["key"].endswith("/xid") for t in d.get("taints") or []) for d in own)


@pytest.mark.parametrize(("change", "final"), [
    ("geometry", lambda body: _gpu0(body) == {"gpu-0-mig-7g80gb-0-0"}),
    ("xid", _xid_tainted)])
def test_a_change_wakes_a_waiting_request_within_2s(agent: AgentProcess, change: str,
                                                    final: Any) -> None:
    """Done-when: after a MIG geometry change (PUT /v1/gpus/0/mig) or an XID on GPU 0, a
    publisher long-polling with the ETag it has (woken by each step: the transition's marks,
    then the new instance) holds the final slices in under 2 s, each answer a new ETag: the
    new geometry, or GPU 0's devices still published with the XID's taint."""
    first = agent.request("GET", URL)
    assert first.status == 200
    assert "gpu-0" in _gpu0(first.body)
    uuid = agent.request("GET", "/v1/gpus/0").body["uuid"]
    held = _held(agent, first.headers["etag"])
    started = time.monotonic()
    if change == "geometry":
        assert agent.request("PUT", "/v1/gpus/0/mig", {"profiles": ["7g.80gb"]}).status == 202
    else:
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202
    reply = held.reply()
    woke = time.monotonic()  # at or after the answer came: the bound below only tightens
    etags = [first.headers["etag"]]
    while reply.status == 200 and not final(reply.body) and woke - started < 5:
        etags.append(reply.headers["etag"])
        reply = agent.request("GET", f"{URL}&wait_s=5", headers={"If-None-Match": etags[-1]})
        woke = time.monotonic()
    assert reply.status == 200
    assert final(reply.body)
    assert woke - started < 2.0, f"final slices after {woke - started:.2f} s"
    assert reply.headers["etag"] not in etags


def test_a_waiting_request_never_holds_the_agents_stop(tmp_path: Path) -> None:
    """SIGTERM answers a held request at once (304) and the agent exits well inside its
    10 s shutdown timeout."""
    agent = start_agent(tmp_path / "state")
    try:
        held = _held(agent, agent.request("GET", URL).headers["etag"])
        started = time.monotonic()
        assert agent.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 5
        assert held.reply().status == 304
    finally:
        agent.stop(signal.SIGKILL)
