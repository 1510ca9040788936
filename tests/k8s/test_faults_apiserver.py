"""The API server's side of the faults, through the real stack: the server unreachable from
the plugin for a while, and the node's slices wiped (kubelet deletes them all when it
starts). The plugin retries, the agent keeps serving, and the slices come back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.k8s.faults import (
    FaultStack,
    StartFaultStack,
    allocated_claim,
    cdi_id,
    fault_stack,
    timed,
)
from tests.k8s.harness import ApiServer
from tests.k8s.stack import wait_for

__all__ = ["fault_stack"]

#: The publisher's backoff tops out at 10 s plus jitter (agent/kubeplugin/publisher.py).
BACK_WITHIN_S = 15.0
REPUBLISH_WITHIN_S = 10.0
ERRORS = "gpu_agent_plugin_slice_publisher_errors_total"
REPUBLISHES = "gpu_agent_plugin_slice_republishes_total"


def published(stack: FaultStack) -> dict[str, Any]:
    """The node's slices in the server: name -> (uid, devices)."""
    return {s["metadata"]["name"]: (s["metadata"]["uid"], s["spec"].get("devices"))
            for s in stack.resource_slices()}


def wipe(stack: FaultStack) -> None:
    """Delete every slice of the node, as an operator with kubectl would."""
    stack.server.kubectl("delete", "resourceslices", "--field-selector",
                         f"spec.nodeName={stack.node}")


@pytest.mark.parametrize("outage_s", [
    4.0,
    # Long enough for the publisher's backoff to reach its 10 s cap.
    pytest.param(30.0, marks=pytest.mark.slow),
], ids=lambda s: f"{s:g}s")
def test_api_server_unreachable_for_a_while(outage_s: float, kube_apiserver: ApiServer,
                                            fault_stack: StartFaultStack) -> None:
    """With the API server unreachable from the plugin (connections refused, the open ones
    cut), the plugin retries (publisher errors counted, attempts logged), its /readyz names
    the API server, a claim it cannot read fails as retryable, and the agent keeps serving
    (a REST prepare, its slices); once the server is reachable again the slices it lost
    meanwhile are published again, /readyz recovers and kubelet's retry prepares the
    claim."""
    node = f"faults-api-outage-{outage_s:g}s"
    stack = fault_stack(kube_apiserver, "l40s", node=node, link=True)
    assert stack.link is not None
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, device = allocated_claim(kube_apiserver, node, node)
    before = published(stack)
    errors_before = stack.plugin.metric(ERRORS, kind="unavailable")

    stack.link.cut()
    cut_at = time.monotonic()
    wait_for("the plugin retrying", lambda: stack.plugin.metric(
        ERRORS, kind="unavailable") >= errors_before + 2, 20, log=stack.plugin.log)
    status, readyz = stack.plugin.readyz()
    assert status == 503 and "API server unreachable" in readyz["checks"]["api_server"], readyz
    first = kubelet.prepare(f"default/{node}")
    assert first["ok"] is False, first
    assert "reading it from the API server failed" in first["error"], first["error"]
    # The agent serves as before: a prepare over REST, and its slices.
    rest = stack.agent.request("PUT", "/v1/claims/rest-during-outage",
                               {"devices": [{"request": "gpu", "device": "gpu-3"}]})
    assert rest.status == 200, rest.body
    assert stack.agent.request("GET", "/v1/resourceslices?kubernetes=1.35").status == 200
    # The server comes back without this node's slices (as a restored one would).
    wipe(stack)
    assert published(stack) == {}
    time.sleep(max(cut_at + outage_s - time.monotonic(), 0))

    stack.link.restore()
    back_s = timed("slices published again", lambda: published(stack).keys() == before.keys(),
                   BACK_WITHIN_S, log=stack.plugin.log)
    ready_s = timed("plugin ready again", lambda: stack.plugin.readyz()[0] == 200, 10)
    assert {name: devices for name, (_, devices) in published(stack).items()} == {
        name: devices for name, (_, devices) in before.items()}
    attempts = [line for line in stack.plugin.log().splitlines()
                if "api server call failed" in line]
    assert len(attempts) >= 2, stack.plugin.log()
    retry = kubelet.prepare(f"default/{node}")
    assert retry["ok"], f"{retry}\n{stack.plugin.log()}"
    assert retry["containers"]["main"] == [cdi_id(uid, device)]
    print(f"\nmeasured: {outage_s:g} s outage; slices back {back_s:.2f} s and /readyz 200 "
          f"{back_s + ready_s:.2f} s after the server was reachable again")


@dataclass(frozen=True)
class Wipe:
    what: str
    run: Callable[[FaultStack], Any]


WIPES = [
    # A kubelet restart: the new kubelet deletes the node's slices when it starts, and
    # registers the plugin again.
    Wipe("kubelet-restart", lambda stack: stack.start_kubelet()),
    Wipe("kubectl-delete", wipe),
]


@pytest.mark.parametrize("how", WIPES, ids=[w.what for w in WIPES])
def test_wiped_slices_are_republished_within_seconds(
        how: Wipe, kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """Every slice of the node deleted by someone else is published again, as new objects
    with the same devices, within 10 s, counted as a republish after deletion."""
    node = f"faults-wipe-{how.what}"
    stack = fault_stack(kube_apiserver, "l40s", node=node)
    before = published(stack)
    republished = stack.plugin.metric(REPUBLISHES, cause="deleted")

    started = time.monotonic()
    how.run(stack)

    def restored() -> bool:
        now = published(stack)
        return now.keys() == before.keys() and all(
            uid != before[name][0] for name, (uid, _) in now.items())

    timed("slices republished", restored, REPUBLISH_WITHIN_S, log=stack.plugin.log)
    took = time.monotonic() - started
    assert {name: devices for name, (_, devices) in published(stack).items()} == {
        name: devices for name, (_, devices) in before.items()}
    assert stack.plugin.metric(REPUBLISHES, cause="deleted") > republished
    stack.plugin.wait_ready()
    print(f"\nmeasured: {how.what}: slices republished {took:.2f} s after the wipe began")
