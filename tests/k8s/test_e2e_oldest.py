"""End to end on the oldest supported Kubernetes (1.34): the same full stack as
test_e2e.py, with a 1.34 API server, the 1.34 allocator and 1.34 kubelet DRA code (which
calls the plugin's v1 or v1beta1 service, whichever it picks)."""

from __future__ import annotations

import pytest

from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.harness import OLDEST, ApiServer
from tests.k8s.objects import devices_of
from tests.k8s.published import set_mig
from tests.k8s.stack import StartStack
from tests.k8s.workload import (
    allocate,
    claim_uid,
    create_pod,
    device_paths,
    example_claim,
    prepare_and_inject,
    unprepare,
)


@pytest.fixture
def oldest(kube_apiservers: StartApiServer) -> ApiServer:
    return kube_apiservers(OLDEST)


def test_full_gpu_and_static_mig_through_the_1_34_stack(oldest: ApiServer,
                                                        stack: StartStack) -> None:
    """On 1.34 the plugin publishes slices the server accepts, a full-GPU claim and a
    1g.10gb claim (after a MIG geometry on GPU 6) are allocated by the 1.34 allocator,
    prepared through 1.34 kubelet with their devices injected, and unprepared."""
    running = stack(oldest, "dgx-h100", node="e2e-oldest")
    assert running.kubelet is not None
    gates = DRA_GATES[OLDEST]
    create_pod(running, "old-full", example_claim("full-gpu.yaml", "old-full"))
    full = allocate(running, "old-full", feature_gates=gates)
    assert full.allocated, full.reason
    [gpu] = full.devices()
    assert gpu != "gpu-6", gpu  # GPU 6 is split below
    _, injected = prepare_and_inject(running, "old-full")
    assert f"/dev/nvidia{gpu.split('-')[1]}" in device_paths(injected)

    set_mig(running.agent, 6, ["1g.10gb"] * 7)
    running.wait_slices(lambda s: sum(n.startswith("gpu-6-mig-1g10gb")
                                      for n in devices_of(s)) == 7)
    create_pod(running, "old-mig", example_claim("mig-1g10gb.yaml", "old-mig"))
    mig = allocate(running, "old-mig", feature_gates=gates)
    assert mig.allocated, mig.reason
    [device] = mig.devices()
    assert device.startswith("gpu-6-mig-1g10gb"), device
    _, injected = prepare_and_inject(running, "old-mig")
    assert any(p.startswith("/dev/nvidia-caps/") for p in device_paths(injected)), injected

    held = {c["uid"]: [d["device_name"] for d in c["devices"]]
            for c in running.agent_claims()}
    assert held == {claim_uid(running, "old-full"): [gpu],
                    claim_uid(running, "old-mig"): [device]}
    unprepare(running, "old-mig")
    unprepare(running, "old-full")
    assert running.agent_claims() == []


def test_dynamic_mig_through_the_1_34_stack(oldest: ApiServer, stack: StartStack) -> None:
    """On 1.34 with DRAPartitionableDevices on, the dynamic 3g.40gb example claim is
    allocated from the counter-sharing slices, its instance is created at the allocated
    placement by the prepare through 1.34 kubelet, and destroyed by the unprepare."""
    running = stack(oldest, "dgx-h100", node="e2e-oldest-dynamic", dynamic_mig=True)
    create_pod(running, "old-dynamic", example_claim("dynamic-mig.yaml", "old-dynamic"))
    answer = allocate(running, "old-dynamic", feature_gates=DRA_GATES[OLDEST])
    assert answer.allocated, answer.reason
    [device] = answer.devices()
    # gpu-<minor>-mig-<profile>-<profile id>-<placement start>
    gpu, start = int(device.split("-")[1]), int(device.split("-")[-1])
    assert "-mig-3g40gb-" in device, device

    _, injected = prepare_and_inject(running, "old-dynamic")
    assert any(p.startswith("/dev/nvidia-caps/") for p in device_paths(injected)), injected
    made = running.agent.request("GET", f"/v1/gpus/{gpu}").body["mig_devices"]
    assert [(m["profile"], m["placement"]["start"]) for m in made] == [("3g.40gb", start)]

    unprepare(running, "old-dynamic")
    assert running.agent.request("GET", f"/v1/gpus/{gpu}").body["mig_devices"] == []
    assert running.agent_claims() == []
