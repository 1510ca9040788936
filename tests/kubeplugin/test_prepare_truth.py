"""One truth between kubelet, the plugin and the agent (issue 22): when the plugin answers a
claim with an error, the agent holds nothing for it, whatever failed, and the next claim for
the same GPU is prepared.

A real agent process and the plugin in this loop, as in test_plugin.py. Between them, where
a test needs the agent's answer to go wrong after the agent has acted on the request, sits
:class:`AnswerProxy`: a Unix socket that hands every request to the real agent and then
answers the plugin as the test says (a body it cannot map, a 500, a cut connection, no answer
at all). The agent's own claims and holds are read from the agent directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.kubeplugin import dra
from agent.kubeplugin.agent_http import UnixHttp
from tests.kubeplugin.conftest import (
    Agent,
    Kubelet,
    close_kubelet,
    open_kubelet,
    result,
    settings_for,
    start_with_plugin_token,
)
from tests.kubeplugin.test_claims_mapping import WRONG_SHAPES
from tests.kubeplugin.test_plugin import metrics
from tests.waiting import until

#: Headers that frame an answer: the proxy writes its own.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class AnswerProxy:
    """A Unix socket in front of the agent's. Every request is handed to the agent; the answer
    to a claim's ``PUT`` (``put``) or ``DELETE`` (``delete``) is then what the mode says
    (``pass``: the agent's own). ``DELETE`` modes other than ``pass`` never reach the agent.
    Each answer closes its connection, so no request of the plugin is ever sent twice."""

    def __init__(self, agent_socket: Path, path: Path) -> None:
        self.path = path
        self.put = "pass"
        self.delete = "pass"
        self.deletes = 0
        self._agent = UnixHttp(str(agent_socket))
        self._server: asyncio.Server | None = None
        self._released = asyncio.Event()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def close(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.close()
        self._agent.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ", 2)
            headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
            length = int(headers.get("Content-Length", "0"))
            raw = await reader.readexactly(length) if length else b""
            claim_call = target.startswith("/v1/claims/")
            mode = (self.put if method == "PUT" else self.delete if method == "DELETE"
                    else "pass") if claim_call else "pass"
            if method == "DELETE" and claim_call:
                self.deletes += 1
                if mode == "close-once":  # lost before the agent saw it; the next one passes
                    self.delete = "pass"
                    return
                if mode == "forbid":
                    await _answer(writer, 403, {}, json.dumps({
                        "type": "https://gpu-agent.dev/problems/forbidden",
                        "detail": "the proxy forbids unprepares"}).encode())
                    return
            sent = {k: v for k, v in headers.items() if k.lower() in (
                "authorization", "if-none-match")}
            answer = await self._agent.request(method, target,
                                               body=json.loads(raw) if raw else None,
                                               headers=sent)
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _FRAMING}
            await self._rewrite(writer, mode, answer.status, kept, answer.body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _rewrite(self, writer: asyncio.StreamWriter, mode: str, status: int,
                       headers: dict[str, str], body: bytes) -> None:
        """Answer the plugin after the agent answered ``status``/``body``."""
        if mode == "pass":
            await _answer(writer, status, headers, body)
        elif mode in ("no-devices", "renamed", "wrong-shape"):
            doc = json.loads(body)
            doc["devices"] = [] if mode == "no-devices" else ["gpu-0"] if mode == "wrong-shape" \
                else [{**d, "device_name": "gpu-elsewhere"} for d in doc["devices"]]
            await _answer(writer, 200, headers, json.dumps(doc).encode())
        elif mode == "html":
            await _answer(writer, 200, {"Content-Type": "text/html"}, b"<html>proxy</html>")
        elif mode == "array":
            await _answer(writer, 200, headers, b"[]")
        elif mode == "error-500":
            await _answer(writer, 500, {"Content-Type": "application/problem+json"},
                          json.dumps({"type": "https://gpu-agent.dev/problems/internal",
                                      "detail": "the proxy failed"}).encode())
        elif mode == "cut":
            await _answer(writer, status, headers, body, cut=True)
        elif mode == "hang":  # never answered: the plugin's claim timeout ends the wait
            await self._released.wait()
        else:
            assert mode == "close", mode  # closed before any byte of the answer


async def _answer(writer: asyncio.StreamWriter, status: int, headers: dict[str, str],
                  body: bytes, *, cut: bool = False) -> None:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") +
                 (body[:len(body) // 2] if cut else body))
    with contextlib.suppress(ConnectionError):
        await writer.drain()


@dataclass
class Node:
    """The agent, the proxy in front of it, and the plugin on the proxy."""

    agent: Agent
    proxy: AnswerProxy
    kubelet: Kubelet

    async def claims(self) -> list[dict[str, Any]]:
        """The agent's claims, as it answers them."""
        reply = await asyncio.to_thread(self.agent.process.request, "GET", "/v1/claims")
        assert reply.status == 200, reply.body
        claims: list[dict[str, Any]] = reply.body["claims"]
        return claims

    async def holds(self, gpu: str = "0") -> list[dict[str, Any]]:
        reply = await asyncio.to_thread(self.agent.process.request, "GET", f"/v1/gpus/{gpu}")
        assert reply.status == 200, reply.body
        holds: list[dict[str, Any]] = reply.body["holds"]
        return holds

    async def holds_nothing(self) -> None:
        """The agent holds no claim and no device of GPU 0."""
        assert await self.claims() == []
        assert await self.holds() == []

    async def next_claim_succeeds(self, name: str) -> None:
        """A new claim for gpu-0 is prepared (the GPU is free), then unprepared."""
        claim = self.kubelet.claims.add(name, [result("gpu-0")])
        answer = (await self.kubelet.prepare(claim))[claim.uid]
        assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-0"]
        assert await self.kubelet.unprepare(claim) == {claim.uid: ""}
        await self.holds_nothing()


@pytest.fixture
async def node(short_dir: Path) -> AsyncIterator[Node]:
    agent = start_with_plugin_token(short_dir / "state")
    proxy = AnswerProxy(agent.process.socket_path, short_dir / "proxy.sock")
    await proxy.start()
    kubelet = await open_kubelet(replace(settings_for(short_dir, agent),
                                         agent_socket=proxy.path))
    yield Node(agent, proxy, kubelet)
    await close_kubelet(kubelet)
    await proxy.close()
    agent.process.stop(signal.SIGKILL)


async def undone(kubelet: Kubelet, outcome: str = "undone") -> float:
    text = await metrics(kubelet)
    line = f'gpu_agent_plugin_prepares_undone_total{{outcome="{outcome}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


#: Every way the agent's answer to a prepare can go wrong after the agent made the claim:
#: (proxy mode, what kubelet's error says).
AFTER_THE_AGENT = [
    ("no-devices", "the agent's answer has no CDI device for gpu-0"),
    ("renamed", "the agent's answer has no CDI device for gpu-0"),
    ("wrong-shape", "the agent's answer: devices[0]: want an object, got string"),
    ("html", "the agent's answer has no CDI device for gpu-0"),
    ("array", "the GPU agent's answer (HTTP 200) is not a claim object"),
    ("error-500", "HTTP 500"),
    ("cut", "closed the connection mid-answer"),
    ("close", "GPU agent unreachable"),
]


async def test_every_failure_after_the_agent_answered_leaves_nothing_held(node: Node) -> None:
    """For each way a prepare can fail in the plugin once the agent has made the claim (an
    answer without the device, of the wrong shape, not JSON, not an object, a 500, cut
    mid-answer, closed unanswered), kubelet's error says so and that it was undone, the agent
    holds nothing, kubelet's retry fails the same way and leaves nothing either, and the
    next claim for the same GPU is prepared."""
    kubelet = node.kubelet
    for n, (mode, expected) in enumerate(AFTER_THE_AGENT):
        node.proxy.put = mode
        claim = kubelet.claims.add(f"broken-{mode}", [result("gpu-0")])
        for attempt in range(2):  # kubelet's call, then its retry
            error = (await kubelet.prepare(claim))[claim.uid].error
            await node.holds_nothing()
            assert expected in error and claim.uid in error, (mode, error)
            assert "undone in the GPU agent" in error, (mode, error)
            assert "internal error" not in error, (mode, error)
            assert await undone(kubelet) == 2 * n + attempt + 1
        node.proxy.put = "pass"
        await node.next_claim_succeeds(f"after-{mode}")


async def test_a_bug_reading_the_agents_answer_is_undone_too(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception the plugin did not foresee while reading the agent's answer still fails
    the claim alone, after undoing it in the agent."""
    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")
    monkeypatch.setattr(dra, "kubelet_devices", broken)
    claim = node.kubelet.claims.add("bug", [result("gpu-0")])
    error = (await node.kubelet.prepare(claim))[claim.uid].error
    await node.holds_nothing()
    assert "RuntimeError: a bug" in error and "undone in the GPU agent" in error, error
    monkeypatch.undo()
    await node.next_claim_succeeds("after-bug")


async def test_an_undo_is_retried_and_one_that_fails_says_so(node: Node) -> None:
    """An unprepare lost on its way to the agent is sent again in the background (kubelet's
    error says so) until the agent holds nothing; one the agent refuses leaves the claim held
    and kubelet's error says so, and kubelet's retry then undoes it."""
    kubelet, proxy = node.kubelet, node.proxy
    proxy.put, proxy.delete = "no-devices", "close-once"
    claim = kubelet.claims.add("lost-undo", [result("gpu-0")])
    error = (await kubelet.prepare(claim))[claim.uid].error
    assert "undoing it in the GPU agent did not get through" in error, error
    assert "retrying" in error and claim.uid in error, error

    async def undone_once() -> bool:
        return await undone(kubelet) == 1
    await until(undone_once, "the undo to be sent again")
    await node.holds_nothing()
    assert proxy.deletes == 2

    proxy.delete = "forbid"
    error = (await kubelet.prepare(claim))[claim.uid].error
    assert "undoing it in the GPU agent failed too" in error and "HTTP 403" in error, error
    assert [c["uid"] for c in await node.claims()] == [claim.uid]
    assert await undone(kubelet, "failed") == 1
    proxy.delete = "pass"
    error = (await kubelet.prepare(claim))[claim.uid].error
    await node.holds_nothing()
    assert "undone in the GPU agent" in error, error
    proxy.put = "pass"
    await node.next_claim_succeeds("after-undo")


async def test_no_answer_in_time_is_undone_even_after_kubelet_stopped_waiting(
        short_dir: Path, node: Node) -> None:
    """A prepare the agent made but never answered (the plugin's claim timeout ends it) is
    undone before kubelet is answered; when kubelet's own deadline passed first, the undo
    still runs, and the agent ends up holding nothing."""
    root = short_dir / "short-timeout"
    root.mkdir()
    hasty = await open_kubelet(replace(settings_for(root, node.agent),
                                       agent_socket=node.proxy.path), claim_timeout_s=3)
    try:
        node.proxy.put = "hang"
        claim = hasty.claims.add("unanswered", [result("gpu-0")])
        error = (await hasty.prepare(claim))[claim.uid].error
        assert "no answer" in error and "undo" in error and claim.uid in error, error

        async def undone_once() -> bool:  # at once, unless the undo too ran out of time
            return await undone(hasty) == 1
        await until(undone_once, "the unanswered prepare to be undone")
        await node.holds_nothing()

        late = hasty.claims.add("abandoned", [result("gpu-0")])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await hasty.prepare(late, deadline_s=0.5)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        async def both_undone() -> bool:
            return await undone(hasty) == 2
        await until(both_undone, "the abandoned prepare to be undone")
        await node.holds_nothing()
    finally:
        await close_kubelet(hasty)
    node.proxy.put = "pass"
    await node.next_claim_succeeds("after-timeout")


# -- devices this node cannot prepare ------------------------------------------------------------

def _uuid_of(agent: Agent, gpu: str) -> str:
    uuid: str = agent.process.request("GET", f"/v1/gpus/{gpu}").body["uuid"]
    return uuid


#: Allocations naming a device the agent must refuse before it holds anything: (results for
#: GPU 0's UUID, the entry and name the error names; ``{uuid}`` is that UUID).
NOT_THIS_NODES: list[tuple[Callable[[str], list[dict[str, Any]]], str]] = [
    (lambda u: [result("gpu-0"), result("1", "b")], "devices[1].device: '1'"),
    (lambda u: [result("0")], "devices[0].device: '0'"),
    (lambda u: [result(u)], "devices[0].device: '{uuid}'"),
    (lambda u: [result("gpu-0"), result("GPU-00000000-0000-0000-0000-00000000dead", "b")],
     "devices[1].device: 'GPU-00000000-0000-0000-0000-00000000dead'"),
    (lambda u: [result("gpu-0"), result("gpu-99", "b")], "devices[1].device 'gpu-99'"),
    (lambda u: [result("gpu-0"), result("gpu-1-mig-1g10gb-19-0", "b")],
     "devices[1].device 'gpu-1-mig-1g10gb-19-0'"),
    (lambda u: [result("gpu-0"), result("0:0", "b")], "devices[1].device: '0:0'"),
]


async def test_an_allocation_naming_a_device_this_node_cannot_prepare_holds_nothing(
        node: Node) -> None:
    """A stale or buggy allocation that names gpu-0 beside a device the node does not
    publish (an index, a UUID, an unknown name, a MIG device that does not exist) is refused
    by the agent with a 422 naming the entry and the device, before anything is held: the
    agent holds nothing, kubelet's retry is refused the same way, and the next claim for
    gpu-0 is prepared."""
    kubelet = node.kubelet
    uuid = await asyncio.to_thread(_uuid_of, node.agent, "0")
    for n, (results, expected) in enumerate(NOT_THIS_NODES):
        named = expected.replace("{uuid}", uuid)
        claim = kubelet.claims.add(f"stale-{n}", results(uuid))
        for _ in range(2):
            error = (await kubelet.prepare(claim))[claim.uid].error
            await node.holds_nothing()
            assert "HTTP 422" in error and named in error, (named, error)
            assert "undone" not in error, error  # refused: nothing was there to undo
        await node.next_claim_succeeds(f"after-stale-{n}")
    assert await undone(kubelet) == 0


async def test_an_allocation_of_the_wrong_shape_is_an_error_naming_the_field(
        node: Node) -> None:
    """Each malformed ResourceClaim of WRONG_SHAPES fails alone, in one call, with an error
    naming the field (never an internal error); the agent holds nothing and a good claim of
    the same call is prepared."""
    kubelet = node.kubelet
    good = kubelet.claims.add("good", [result("gpu-0")])
    broken = {}
    for n, (change, field) in enumerate(WRONG_SHAPES):
        claim = kubelet.claims.add(f"shape-{n}", [result("gpu-1")])
        change(kubelet.claims.objects[("default", claim.name)])
        broken[claim.uid] = (claim, field)
    answer = await kubelet.prepare(good, *(c for c, _ in broken.values()))
    assert answer[good.uid].error == ""
    for uid, (_, field) in broken.items():
        error = answer[uid].error
        assert field in error and uid in error, (field, error)
        assert "internal error" not in error, error
    assert [c["uid"] for c in await node.claims()] == [good.uid]
    assert await kubelet.unprepare(good) == {good.uid: ""}
    await node.holds_nothing()


async def test_a_dynamic_slice_this_node_cannot_make_holds_nothing(short_dir: Path) -> None:
    """With --dynamic-mig, a claim of a whole GPU and a partitionable MIG device whose GPU or
    profile the node does not have is refused naming the slice's entry; the whole GPU is not
    held meanwhile, and a claim of it alone is prepared next."""
    agent = start_with_plugin_token(short_dir / "state", extra=["--dynamic-mig"])
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    try:
        claim = kubelet.claims.add("bad-slice", [result("gpu-0"),
                                                 result("gpu-9-mig-1g10gb-19-0", "s")])
        error = (await kubelet.prepare(claim))[claim.uid].error
        assert "HTTP 422" in error and "devices[1].device" in error, error
        assert agent.process.request("GET", "/v1/claims").body["claims"] == []
        alone = kubelet.claims.add("alone", [result("gpu-0")])
        assert (await kubelet.prepare(alone))[alone.uid].error == ""
    finally:
        await close_kubelet(kubelet)
        agent.process.stop(signal.SIGKILL)

