"""Kubelet's deadline passing during a prepare, through the real stack: kubelet stops waiting
(its gRPC deadline; 45 s in kubelet, shortened here through the harness's call timeout), the
plugin lets the agent's prepare finish, and kubelet's retry, whether it comes while that
prepare still runs or after, gets its result without a second slice being made."""

from __future__ import annotations

import pytest

from tests.k8s.faults import (
    DYNAMIC_MIG_CLASS,
    StartFaultStack,
    allocated_claim,
    cdi_id,
    fault_stack,
    gpu_of,
    mig_devices,
    set_latency,
    sim_calls,
)
from tests.k8s.harness import ApiServer
from tests.k8s.objects import attr, request
from tests.k8s.stack import wait_for

__all__ = ["fault_stack"]

CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
SLOW_S = 4.0
DEADLINE_S = 1.0
FINISHED_LATE = "gpu_agent_plugin_finished_after_deadline_total"


@pytest.mark.parametrize("retry_while_running", [True, False],
                         ids=["retry-while-running", "retry-after-it-finished"])
def test_prepare_past_kubelets_deadline_finishes_and_the_retry_finds_it(
        retry_while_running: bool, kube_apiserver: ApiServer,
        fault_stack: StartFaultStack) -> None:
    """A dynamic-MIG prepare slower than kubelet's deadline fails kubelet's call with the
    deadline, finishes in the agent anyway (counted as finished after the deadline), and
    kubelet's retry gets the claim's CDI device with the one slice that prepare made."""
    node = "faults-deadline-" + ("during" if retry_while_running else "after")
    stack = fault_stack(kube_apiserver, "dgx-h100", node=node, dynamic_mig=True)
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, device = allocated_claim(kube_apiserver, node, node, request(
        device_class_name=DYNAMIC_MIG_CLASS, selectors=(f'{attr("profile")} == "1g.10gb"',)))
    set_latency(stack.agent, {CREATE_GI: SLOW_S})

    first = kubelet.prepare(f"default/{node}", timeout=DEADLINE_S)
    assert first["ok"] is False and "deadline" in first["error"].lower(), first
    if retry_while_running:
        assert all(c["state"] != "prepare_completed" for c in stack.agent_claims())
    else:
        wait_for("the prepare finished after the deadline", lambda: stack.plugin.metric(
            FINISHED_LATE, call="prepare") == 1, SLOW_S + 20, log=stack.plugin.log)
        assert [c["uid"] for c in stack.agent_claims()] == [uid]

    retry = kubelet.prepare(f"default/{node}", timeout=SLOW_S + 30)
    assert retry["ok"], f"{retry}\n{stack.plugin.log()}"
    assert retry["containers"]["main"] == [cdi_id(uid, device)]
    assert [c["uid"] for c in stack.agent_claims()] == [uid]
    assert len(mig_devices(stack.agent, gpu_of(device))) == 1
    assert sim_calls(stack.agent, CREATE_GI) == 1
    wait_for("the first prepare counted as finished late", lambda: stack.plugin.metric(
        FINISHED_LATE, call="prepare") == 1, 10, log=stack.plugin.log)
