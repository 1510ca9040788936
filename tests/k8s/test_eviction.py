"""NoExecute, asserted on what Kubernetes does with it: kube-controller-manager's device taint
eviction controller (the Go harness's ``evict``) watching a real API server marks a pod for
eviction (the ``DisruptionTarget`` condition, then a graceful delete) when a device its claim
was allocated gets a ``NoExecute`` taint, and leaves a pod whose claim tolerates the taint
alone, on a slice the test writes itself: the controller and the test bed. The agent's own
NoExecute taints (``--no-execute-taints``, XID 79) meet it in test_health.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s.device_taints import (
    EVICTION_REASON,
    TOLERATION_PROTECTS,
    XID_KEY,
    device_taints,
    disruption,
    evicted,
    tolerating,
    toleration,
    untouched,
)
from tests.k8s.fixtures import DRA_GATES, StartApiServer, StartEviction
from tests.k8s.harness import EVICTION_SERVER_FLAGS, VERSIONS, ApiServer, allocate_in_cluster
from tests.k8s.objects import DRIVER, RESOURCE, pod, request
from tests.k8s.objects import claim as claim_object
from tests.k8s.stack import DEVICE_CLASSES, apply_shipped, wait_for

Json = dict[str, Any]
GPU_CLASS = "gpu.nodeagent.dev"
TOLERATE_XID = toleration(XID_KEY, effect="NoExecute")


def eviction_server(kube_apiservers: StartApiServer, version: str) -> ApiServer:
    """The version's shared server with what the eviction controller needs served."""
    return kube_apiservers(version, extra=EVICTION_SERVER_FLAGS[version])


def own_slice(node: str, devices: list[str]) -> Json:
    """A ResourceSlice of this driver for ``node`` with whole-GPU devices (``type: gpu``, what
    the shipped DeviceClass selects), as a driver would publish it."""
    return {"apiVersion": RESOURCE, "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpus"},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": d, "attributes": {"type": {"string": "gpu"}}}
                                 for d in devices]}}


def assert_evictions(server: ApiServer, version: str, plain: str, tolerant: str,
                     log: Callable[[], str]) -> None:
    """``plain`` is evicted (DisruptionTarget with the device taint manager's reason, and a
    deletion timestamp); ``tolerant`` stays where the version honours its toleration."""
    gone = wait_for(f"{plain} evicted", lambda: evicted(server, plain), 60, 0.2, log=log)
    condition = disruption(gone)
    assert condition is not None and condition["reason"] == EVICTION_REASON, condition
    if TOLERATION_PROTECTS[version]:
        assert untouched(server, tolerant), log()
    else:
        wait_for(f"{tolerant} evicted despite its toleration (1.34)",
                 lambda: evicted(server, tolerant), 60, 0.2, log=log)


@pytest.mark.parametrize("version", VERSIONS)
def test_no_execute_taint_evicts_the_pod_that_does_not_tolerate_it(
        version: str, kube_apiservers: StartApiServer,
        device_taint_eviction: StartEviction) -> None:
    """Both devices of a node get a NoExecute XID taint: the pod whose claim does not
    tolerate it gets DisruptionTarget (reason DeletionByDeviceTaintManager) and a deletion
    timestamp from the controller; the pod whose claim tolerates ``<driver>/xid`` NoExecute
    stays, not deleted and without the condition (on 1.37; 1.34 evicts it too:
    :data:`TOLERATION_PROTECTS`)."""
    server = eviction_server(kube_apiservers, version)
    controller = device_taint_eviction(server)
    node = f"evict-{version.replace('.', '')}-{uuid.uuid4().hex[:6]}"
    server.ensure_node(node)
    apply_shipped(server, DEVICE_CLASSES)
    server.apply([own_slice(node, ["gpu-0", "gpu-1"])])
    plain, tolerant = f"{node}-plain", f"{node}-tolerant"
    server.apply([
        claim_object(plain, request(device_class_name=GPU_CLASS)),
        tolerating(claim_object(tolerant, request(device_class_name=GPU_CLASS)), [TOLERATE_XID]),
        pod(plain, {"gpu": plain}, node_name=node), pod(tolerant, {"gpu": tolerant},
                                                        node_name=node)])
    for name in (plain, tolerant):
        # The scheduler runs with the cluster's gates: on 1.34 DRADeviceTaints, without which
        # the allocator neither honours taints nor copies tolerations into the allocation
        # (where the eviction controller reads them).
        answer = allocate_in_cluster(server, node=node, claims=[f"default/{name}"],
                                     pod=f"default/{name}", feature_gates=DRA_GATES[version])
        assert answer.allocated, answer.reason
    status, stored = server.request("GET", f"/apis/resource.k8s.io/v1/resourceslices/{node}-gpus")
    assert status == 200, stored
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for device in stored["spec"]["devices"]:
        device["taints"] = [{"key": XID_KEY, "value": "79", "effect": "NoExecute",
                             "timeAdded": stamp}]
    status, body = server.request("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{node}-gpus",
                                  stored)
    assert status == 200, body
    assert device_taints(server, node, "gpu-0") == [
        {"key": XID_KEY, "value": "79", "effect": "NoExecute", "timeAdded": stamp}]

    assert_evictions(server, version, plain, tolerant, controller.log)
