"""Restarts in the middle of kubelet's NodePrepareResources, through the real stack (kubelet's
DRA manager -> ``gpu-agent kubelet-plugin`` -> the agent): a dynamic-MIG claim whose slice
the agent is still making when the agent or the plugin dies. Kubelet's retry gets the answer
an undisturbed prepare gives, and nothing is left half-made."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

import pytest

from tests.k8s.faults import (
    DYNAMIC_MIG_CLASS,
    FaultStack,
    StartFaultStack,
    add_fault,
    allocated_claim,
    cdi_id,
    fault_stack,
    gpu_of,
    in_background,
    mig_devices,
    set_latency,
    sim_calls,
)
from tests.k8s.harness import ApiServer
from tests.k8s.objects import DRIVER, attr, request
from tests.k8s.stack import wait_for

__all__ = ["fault_stack"]

CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
CREATE_CI = "nvmlGpuInstanceCreateComputeInstance"
ONE_G = request(device_class_name=DYNAMIC_MIG_CLASS,
                selectors=(f'{attr("profile")} == "1g.10gb"',))


@dataclass(frozen=True)
class Crash:
    """How the agent dies while the claim's slice is being made."""

    what: str
    slow: bool  # the GPU instance creation is slowed and the test kills -9 the agent in it
    crash_at: str | None = None  # else the simulator kills the agent at this NVML call


CRASHES = [
    Crash("kill-9-while-creating-the-gpu-instance", slow=True),
    # The GPU instance exists, its compute instance does not: the most half-made a slice gets.
    Crash("crash-between-gpu-and-compute-instance", slow=False, crash_at=CREATE_CI),
]


def gpu_view(stack: FaultStack, gpu: int) -> dict[str, Any]:
    reply = stack.agent.request("GET", f"/v1/gpus/{gpu}")
    assert reply.status == 200, reply.body
    return dict(reply.body)


def assert_holds_exactly(stack: FaultStack, uid: str, device: str) -> None:
    """The agent holds one claim, ``uid``, on exactly ``device``, whose GPU has that one MIG
    instance and one hold."""
    [held] = stack.agent_claims()
    assert held["uid"] == uid and held["state"] == "prepare_completed", held
    assert [d["device_name"] for d in held["devices"]] == [device], held
    gpu = gpu_of(device)
    assert len(mig_devices(stack.agent, gpu)) == 1
    holds = gpu_view(stack, gpu)["holds"]
    assert [h["claim"] for h in holds] == [uid], holds


@pytest.mark.parametrize("crash", CRASHES, ids=[c.what for c in CRASHES])
def test_agent_killed_mid_prepare_kubelet_retry_gets_the_same_answer(
        crash: Crash, kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """An agent killed while making a claim's dynamic-MIG slice fails that prepare as
    retryable ("unreachable"); restarted on the same state dir it holds nothing of the claim
    (no claim, no instance, no hold), and kubelet's retry gets the claim's own CDI device
    with exactly one instance made; unprepare then removes it."""
    node = "faults-agent-" + ("slow" if crash.slow else "crash")
    stack = fault_stack(kube_apiserver, "dgx-h100", node=node, dynamic_mig=True)
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, device = allocated_claim(kube_apiserver, node, node, ONE_G)
    gpu = gpu_of(device)
    mode_before = gpu_view(stack, gpu)["mig_mode"]
    assert mode_before == {"current": False, "pending": False}  # the prepare switches it on
    if crash.slow:
        set_latency(stack.agent, {CREATE_GI: 20.0})
    else:
        assert crash.crash_at is not None
        add_fault(stack.agent, crash.crash_at, "CRASH")

    in_flight = in_background(lambda: kubelet.prepare(f"default/{node}"))
    if crash.slow:
        wait_for("the GPU instance creation started", lambda: sim_calls(stack.agent, CREATE_GI),
                 30, log=stack.agent.log)
        stack.kill_agent(signal.SIGKILL)
    else:
        assert stack.agent.proc.wait(30) == -signal.SIGKILL
    first = in_flight.result(90)
    assert first["ok"] is False, first
    assert "unreachable" in first["error"] and uid in first["error"], first["error"]

    stack.start_agent()  # same state dir: recovery rolls the half-made slice back
    assert stack.agent_claims() == []
    after = gpu_view(stack, gpu)
    assert after["mig_devices"] == [] and after["holds"] == [], after
    assert after["mig_mode"] == mode_before, after  # the MIG switch-on rolled back too
    assert not list(stack.cdi_dir.glob(f"*claim_{uid}*")), sorted(stack.cdi_dir.iterdir())

    retry = kubelet.prepare(f"default/{node}")
    assert retry["ok"], f"{retry}\n{stack.plugin.log()}"
    assert retry["containers"]["main"] == [cdi_id(uid, device)]
    assert_holds_exactly(stack, uid, device)
    assert gpu_view(stack, gpu)["mig_mode"]["current"] is True
    assert sim_calls(stack.agent, CREATE_GI) == 1

    assert kubelet.unprepare(f"default/{node}")["ok"]
    assert stack.agent_claims() == [] and mig_devices(stack.agent, gpu) == []


def test_plugin_killed_mid_prepare_is_registered_again_and_the_retry_gets_the_same_answer(
        kube_apiserver: ApiServer, fault_stack: StartFaultStack) -> None:
    """A plugin SIGKILLed while the agent makes a claim's dynamic-MIG slice fails kubelet's
    call; started again it is registered again by kubelet's plugin watcher, and kubelet's
    retry gets the claim's CDI device while the agent holds the claim once, with one
    instance made in all."""
    node = "faults-plugin-restart"
    stack = fault_stack(kube_apiserver, "dgx-h100", node=node, dynamic_mig=True)
    kubelet = stack.kubelet
    assert kubelet is not None
    uid, device = allocated_claim(kube_apiserver, node, node, ONE_G)
    set_latency(stack.agent, {CREATE_GI: 3.0})

    in_flight = in_background(lambda: kubelet.prepare(f"default/{node}"))
    wait_for("the GPU instance creation started", lambda: sim_calls(stack.agent, CREATE_GI),
             30, log=stack.agent.log)
    stack.plugin.stop(signal.SIGKILL)
    first = in_flight.result(90)
    assert first["ok"] is False, first

    plugin = stack.start_plugin()
    ready = plugin.wait_ready()  # "registered" is kubelet's NotifyRegistrationStatus to it
    assert ready["checks"]["registered"] == "ok", ready
    assert plugin.metric("gpu_agent_plugin_registered") == 1
    assert kubelet.call("registered", driver=DRIVER)["registered"] is True

    retry = kubelet.prepare(f"default/{node}")
    assert retry["ok"], f"{retry}\n{plugin.log()}"
    assert retry["containers"]["main"] == [cdi_id(uid, device)]
    assert_holds_exactly(stack, uid, device)
    assert sim_calls(stack.agent, CREATE_GI) == 1

    assert kubelet.unprepare(f"default/{node}")["ok"]
    assert stack.agent_claims() == []
