"""The plugin's health stream as kubelet receives it: kubelet's own DRA manager (the Go
harness, 1.37 and 1.34) registered with the real ``gpu-agent kubelet-plugin`` opens the
stream itself, and what its health cache holds for a pod is read through kubelet's own
``UpdateAllocatedResourcesStatus`` (the harness's ``resource-health`` op), i.e. what kubelet
writes into ``status.containerStatuses[].allocatedResourcesStatus``."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.objects import DRIVER
from tests.k8s.objects import pod as pod_object
from tests.k8s.stack import DEVICE_CLASSES, Stack, StartStack, apply_shipped
from tests.k8s.workload import allocate, example_claim, prepare_and_inject
from tests.waiting import wait_for

Json = dict[str, Any]
#: Generous: the whole stack on a loaded 2-core machine.
WAIT_S = 60.0
#: What each version's kubelet needs for the stream: 1.37 has ResourceHealthStatus on by
#: default (beta since 1.36); 1.34 has it alpha and off.
HEALTH_GATES = {"1.37": "", "1.34": "ResourceHealthStatus=true"}


def resource_health(stack: Stack, pod: str) -> Json:
    """The harness's answer: ``gate``, ``containers`` (name -> allocatedResourcesStatus) and
    ``updates`` (health-driven pod syncs the manager asked for)."""
    assert stack.kubelet is not None
    answer = stack.kubelet.call("resource-health", pod=f"default/{pod}")
    assert answer["ok"], answer
    return answer


def kubelet_sees(stack: Stack, pod: str, cdi_id: str, health: str, *,
                 updates_above: int = -1) -> Json:
    """Wait until kubelet's DRA manager gives the pod's container ``main`` (its claim, named
    as the pod) the one device ``cdi_id`` with ``health``, having asked for more than
    ``updates_above`` syncs of the pod (it asks after updating its cache); the answer."""
    def check() -> Json | None:
        answer = resource_health(stack, pod)
        statuses = answer["containers"]["main"]
        found = [(s["name"], r["resourceID"], r["health"]) for s in statuses
                 for r in s["resources"]]
        if found == [(f"claim:{pod}", cdi_id, health)] and answer["updates"] > updates_above:
            return answer
        return None

    answer: Json = wait_for(check, f"kubelet to hold {cdi_id} {health}", WAIT_S)
    return answer


def prepared_pod(stack: Stack, pod: str, version: str) -> tuple[str, str]:
    """A full-GPU pod allocated and prepared through kubelet: its device and CDI ID. The
    pod's claim entry is named as the ResourceClaim: 1.34's kubelet looks a container's
    claims up by the entry's name where it means the claim's (1.37 resolves it), so with
    other names it reports no health at all."""
    apply_shipped(stack.server, DEVICE_CLASSES)
    stack.server.apply([example_claim("full-gpu.yaml", pod),
                        pod_object(pod, {pod: pod}, node_name=stack.node)])
    answer = allocate(stack, pod, feature_gates=DRA_GATES[version])
    assert answer.allocated, answer.reason
    [device] = answer.devices()
    [cdi_id], _ = prepare_and_inject(stack, pod)
    return device, cdi_id


@pytest.mark.parametrize("version", ["1.37", "1.34"])
def test_a_device_health_change_reaches_kubelets_dra_manager(
        version: str, kube_apiservers: StartApiServer, stack: StartStack) -> None:
    """The prepared GPU is Healthy in kubelet's DRA manager; XID 48 on it turns it Unhealthy
    (1.37 also keeps the message: the taint), a reset back to Healthy; each change makes the
    manager ask for the pod's status to be synced, as kubelet's pod workers hear it."""
    node = f"kh-{version.replace('.', '-')}"
    running = stack(kube_apiservers(version), "dgx-h100", node=node,
                    kubelet_gates=HEALTH_GATES[version])
    device, cdi_id = prepared_pod(running, "kh", version)
    seen = kubelet_sees(running, "kh", cdi_id, "Healthy")
    assert seen["gate"] is True

    gpu = device.split("-")[1]
    asked = time.monotonic()
    assert running.agent.request("POST", "/v1/sim/xid", {"gpu": gpu, "xid": 48}).status == 202
    lost_seen = kubelet_sees(running, "kh", cdi_id, "Unhealthy", updates_above=seen["updates"])
    print(f"kubelet {version} held the device Unhealthy {time.monotonic() - asked:.2f} s after "
          "the XID was raised (polled every 20 ms)")
    [status] = lost_seen["containers"]["main"]
    [resource] = status["resources"]
    # 1.37's ResourceHealthStatusMessage (beta, on) keeps the message; 1.34 has none.
    assert resource.get("message") == (f"{DRIVER}/xid=48:NoSchedule" if version == "1.37"
                                       else None), resource

    assert running.agent.request("POST", "/v1/sim/reset", {"gpu": gpu}).status == 204
    kubelet_sees(running, "kh", cdi_id, "Healthy", updates_above=lost_seen["updates"])


def test_kubelet_reads_unknown_while_the_agent_is_lost_and_after_a_plugin_restart_healthy(
        kube_apiservers: StartApiServer, stack: StartStack) -> None:
    """The agent gone past --agent-lost-after: kubelet holds the device Unknown (nobody
    knows its health); the agent back: Healthy. The plugin stopped: its stream ends and
    kubelet forgets the driver's health (Unknown); started again (kubelet does not prepare
    again), it streams the device Healthy: the prepared claims come from the agent."""
    version = "1.37"
    running = stack(kube_apiservers(version), "dgx-h100", node="kh-lost",
                    plugin_extra=["--agent-lost-after", "1"])
    _, cdi_id = prepared_pod(running, "kl", version)
    kubelet_sees(running, "kl", cdi_id, "Healthy")

    running.kill_agent()
    kubelet_sees(running, "kl", cdi_id, "Unknown")
    running.start_agent()
    kubelet_sees(running, "kl", cdi_id, "Healthy")

    assert running.plugin.stop() == 0
    kubelet_sees(running, "kl", cdi_id, "Unknown")
    running.start_plugin()
    kubelet_sees(running, "kl", cdi_id, "Healthy")


def test_a_1_34_kubelet_without_the_gate_ignores_the_stream(
        kube_apiservers: StartApiServer, stack: StartStack) -> None:
    """1.34's kubelet with ResourceHealthStatus off (its default) registers the plugin that
    lists the health service, prepares through it, and writes no allocatedResourcesStatus."""
    version = "1.34"
    running = stack(kube_apiservers(version), "dgx-h100", node="kh-off")
    prepared_pod(running, "ko", version)
    answer = resource_health(running, "ko")
    assert (answer["gate"], answer["containers"], answer["updates"]) == (
        False, {"main": []}, 0), answer
