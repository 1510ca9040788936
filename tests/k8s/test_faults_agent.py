"""The agent behind the plugin not ready, or gone, through the real stack: kubelet's calls get
per-claim errors that say which, the publisher takes the pool away from the scheduler only
once the agent has been gone longer than ``--agent-lost-after``, and everything resumes when
the agent is back."""

from __future__ import annotations

import signal
import time

from tests.k8s.faults import (
    StartFaultStack,
    allocated_claim,
    cdi_id,
    fault_stack,
    start_agent_unready,
    timed,
)
from tests.k8s.harness import ApiServer
from tests.k8s.objects import DRIVER

__all__ = ["fault_stack"]

# nvmlInit fails three times: the restarted agent listens, unready, for 0.5 + 1 + 2 s of
# backoff at least (agent/daemon.py), while it answers claims 503 not-ready.
DRIVER_LATE = [{"function": "nvmlInit", "error": "NVML_ERROR_DRIVER_NOT_LOADED", "times": 3}]
LOST_AFTER_S = 3.0


def test_prepare_while_the_agent_is_not_ready_is_a_retryable_not_ready_error(
        kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """While a restarted agent recovers (listening, answering 503 not-ready), kubelet's
    prepare fails with the claim's error saying the agent is not ready and when to retry,
    never "unreachable", and the plugin's /readyz names the agent; once the agent is ready
    kubelet's retry prepares the claim."""
    node = "faults-not-ready"
    stack = fault_stack(kube_apiserver, "l40s", node=node)
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, device = allocated_claim(kube_apiserver, node, node)
    stack.kill_agent(signal.SIGKILL)
    agent = start_agent_unready(stack, DRIVER_LATE)
    assert agent.request("GET", "/readyz", token=None).status == 503

    first = kubelet.prepare(f"default/{node}")
    assert first["ok"] is False, first
    assert "not ready" in first["error"] and "retry in" in first["error"], first["error"]
    assert "unreachable" not in first["error"] and uid in first["error"], first["error"]
    assert stack.plugin.metric("gpu_agent_plugin_prepare_errors_total",
                               reason="agent-not-ready") == 1
    status, readyz = stack.plugin.readyz()
    assert status == 503 and "agent not ready" in readyz["checks"]["agent"], readyz

    agent.wait_ready()
    retry = kubelet.prepare(f"default/{node}")
    assert retry["ok"], f"{retry}\n{stack.plugin.log()}"
    assert retry["containers"]["main"] == [cdi_id(uid, device)]
    assert [c["uid"] for c in stack.agent_claims()] == [uid]
    stack.plugin.wait_ready()


def test_agent_gone_longer_than_agent_lost_after_deletes_the_pool_until_it_returns(
        kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """With the agent killed, the node's slices stay for --agent-lost-after (3 s) and are
    then deleted; the plugin stays registered, so kubelet's unprepare still reaches it (and
    fails as retryable, the agent unreachable); with the agent back the same slices return
    and the retried unprepare releases the claim."""
    node = "faults-agent-lost"
    stack = fault_stack(kube_apiserver, "l40s", node=node,
                        plugin_extra=["--agent-lost-after", f"{LOST_AFTER_S:g}"])
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, _ = allocated_claim(kube_apiserver, node, node)
    assert kubelet.prepare(f"default/{node}")["ok"]
    published = sorted(s["metadata"]["name"] for s in stack.resource_slices())

    killed = time.monotonic()
    stack.kill_agent(signal.SIGKILL)
    # A restart's worth of absence keeps the pool: still there just before the limit.
    time.sleep(max(killed + LOST_AFTER_S - 0.5 - time.monotonic(), 0))
    assert sorted(s["metadata"]["name"] for s in stack.resource_slices()) == published
    timed("pool deleted", lambda: not stack.resource_slices(), 30, log=stack.plugin.log)
    gone_s = time.monotonic() - killed
    assert gone_s <= LOST_AFTER_S + 5, gone_s
    assert stack.plugin.metric("gpu_agent_plugin_slice_pool_deletions_total") == 1
    status, readyz = stack.plugin.readyz()
    assert status == 503 and "pool deleted" in readyz["checks"]["slices"], readyz

    assert kubelet.call("registered", driver=DRIVER)["registered"] is True
    during = kubelet.unprepare(f"default/{node}")
    assert during["ok"] is False and "unreachable" in during["error"], during

    stack.start_agent()
    back_s = timed("slices republished", lambda: sorted(
        s["metadata"]["name"] for s in stack.resource_slices()) == published, 30,
        log=stack.plugin.log)
    assert stack.plugin.metric("gpu_agent_plugin_slice_republishes_total",
                               cause="agent_returned") >= 1
    assert [c["uid"] for c in stack.agent_claims()] == [uid]
    assert kubelet.unprepare(f"default/{node}")["ok"]
    assert stack.agent_claims() == []
    stack.plugin.wait_ready()
    print(f"\nmeasured: pool deleted {gone_s:.2f} s after the kill "
          f"(--agent-lost-after {LOST_AFTER_S:g}); slices back {back_s:.2f} s after the "
          "agent was ready again")
