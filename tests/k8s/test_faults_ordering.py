"""A late prepare after an unprepare (NVIDIA's dra-driver #1162), end to end: kubelet's gRPC
calls to the real ``gpu-agent kubelet-plugin``, which reads the claim from the real API server
and prepares through the real agent. Kubelet's own client cannot reorder its calls, so this
test is kubelet (a grpc.aio client with the plugin's stubs) and holds the plugin's claim read
in an :class:`~tests.k8s.link.ApiServerLink` to make the prepare arrive at the agent last."""

from __future__ import annotations

import asyncio

import grpc

from agent.kubeplugin.proto import dra_v1_pb2, dra_v1_pb2_grpc
from tests.k8s.faults import FaultStack, StartFaultStack, allocated_claim, cdi_id, fault_stack
from tests.k8s.harness import ApiServer
from tests.k8s.objects import DRIVER
from tests.waiting import until

__all__ = ["fault_stack"]

HELD_WITHIN_S = 10.0
IN_FLIGHT = "gpu_agent_plugin_claims_in_flight"


async def wait_until_held(stack: FaultStack) -> None:
    """Until the prepare is in the plugin (stamped: a claim call in flight) and the plugin has
    sent the API server something the link holds (its read of the claim)."""
    link = stack.link
    assert link is not None
    await until(lambda: link.held_bytes > 0 and stack.plugin.metric(IN_FLIGHT) == 1,
                "the prepare's claim read to reach the link", HELD_WITHIN_S)


async def late_then_fresh(stack: FaultStack, claim: dra_v1_pb2.Claim
                          ) -> tuple[str, str, dra_v1_pb2.NodePrepareResourceResponse]:
    """Kubelet's calls: a prepare whose claim read is held, an unprepare sent after it and
    answered first, then (the read released) the late prepare's answer; then a prepare sent
    after the unprepare. (late prepare's error, unprepare's error, fresh prepare's answer)."""
    assert stack.link is not None
    socket = stack.plugins_dir / DRIVER / "dra.sock"
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        prepare = dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim])
        stack.link.hold()
        try:
            late = asyncio.ensure_future(stub.NodePrepareResources(prepare, timeout=30))
            await wait_until_held(stack)
            unprepared = await stub.NodeUnprepareResources(
                dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)
        finally:
            stack.link.release()
        late_answer = await late
        fresh = await stub.NodePrepareResources(prepare, timeout=30)
    return (late_answer.claims[claim.uid].error, unprepared.claims[claim.uid].error,
            fresh.claims[claim.uid])


def test_prepare_sent_before_an_unprepare_but_arriving_after_it_is_refused(
        kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """A prepare kubelet sent before an unprepare of the same claim, reaching the agent after
    it, is refused (claim-unprepared) and prepares nothing; a prepare sent after the
    unprepare, with the same allocation, is a legitimate re-prepare and succeeds."""
    node = "faults-late-prepare"
    stack = fault_stack(kube_apiserver, "l40s", node=node, link=True, kubelet=False)
    uid, device = allocated_claim(kube_apiserver, node, node)
    claim = dra_v1_pb2.Claim(namespace="default", name=node, uid=uid)

    late_error, unprepare_error, fresh = asyncio.run(late_then_fresh(stack, claim))

    assert unprepare_error == ""
    assert "claim-unprepared" in late_error and uid in late_error, late_error
    assert fresh.error == "", f"{fresh.error}\n{stack.plugin.log()}"
    assert [list(d.cdi_device_ids) for d in fresh.devices] == [[cdi_id(uid, device)]]
    assert [(d.pool_name, d.device_name) for d in fresh.devices] == [(node, device)]
    assert [c["uid"] for c in stack.agent_claims()] == [uid]
    assert stack.plugin.metric("gpu_agent_plugin_prepare_errors_total",
                               reason="agent-refused") == 1
