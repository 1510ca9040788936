"""Pod attribution through kubelet's own PodResources server: a Pod's claim prepared through
kubelet's DRA manager -> ``gpu-agent kubelet-plugin`` -> the agent; the agent, polling the
PodResources v1 API that kubelet's ``podresources`` package serves from that DRA manager's
claim cache (tests/k8s/src/podresources.go), labels the claimed device's DCGM series with the
pod, namespace and container, as dcgm-exporter does, and drops the labels after unprepare."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent_process import AgentProcess
from tests.k8s.fixtures import StartApiServer
from tests.k8s.harness import VERSIONS
from tests.k8s.objects import DRIVER
from tests.k8s.stack import StartStack, wait_for
from tests.k8s.workload import allocate, create_pod, example_claim, prepare_and_inject, unprepare

POD_LABELS = ("pod", "namespace", "container")
SERIES = "DCGM_FI_DEV_POWER_USAGE"


def series(agent: AgentProcess, name: str = SERIES) -> list[dict[str, str]]:
    """The label sets of every sample of ``name`` on the agent's /metrics."""
    reply = agent.request("GET", "/metrics")
    assert reply.status == 200, reply.body
    text = reply.body if isinstance(reply.body, str) else reply.body.decode()
    return [dict(s.labels) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for the agent's view of kubelet's socket (a symlink to it: the
    stack starts the agent before kubelet, and the agent dials the path at every poll)."""
    path = Path(tempfile.mkdtemp(prefix="podres-agent-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_prepared_claim_labels_its_device_series_with_the_pod_until_unprepared(
        version: str, kube_apiservers: StartApiServer, stack: StartStack,
        socket_dir: Path) -> None:
    """While kubelet holds a prepared full-GPU claim for pod default/trainer, exactly that
    GPU's series carry pod, namespace and container (and the DRA claim, driver, pool and
    device names) from kubelet's PodResources answer; every other GPU's series carry none;
    after unprepare no series carries them."""
    server = kube_apiservers(version)
    link = socket_dir / "kubelet.sock"
    node = f"podres-{version}".replace(".", "-")
    running = stack(server, "dgx-h100", node=node,
                    agent_extra=["--pod-resources-socket", str(link),
                                 "--collect-interval", "0.2"])
    assert running.kubelet is not None
    link.symlink_to(running.kubelet.pod_resources_socket)

    create_pod(running, "trainer", example_claim("full-gpu.yaml", "trainer"))
    answer = allocate(running, "trainer")
    assert answer.allocated, answer.reason
    [device] = answer.devices()
    minor = int(device.split("-")[1])
    gpus = running.agent.request("GET", "/v1/gpus").body["gpus"]
    [uuid] = [g["uuid"] for g in gpus if g["minor"] == minor]
    assert all(not set(POD_LABELS) & set(s) for s in series(running.agent))

    prepare_and_inject(running, "trainer")

    def attributed() -> list[dict[str, str]]:
        return [s for s in series(running.agent) if "container" in s]

    [held] = wait_for("the claimed GPU's series labelled with the pod", attributed, 30,
                      log=running.agent.log)
    assert held["UUID"] == uuid, held
    assert {k: held.get(k) for k in POD_LABELS} == {
        "pod": "trainer", "namespace": "default", "container": "main"}, held
    assert {k: held[k] for k in ("dra_claim_name", "dra_claim_namespace", "dra_driver_name",
                                 "dra_device_name")} == {
        "dra_claim_name": "trainer", "dra_claim_namespace": "default",
        "dra_driver_name": DRIVER, "dra_device_name": device}
    assert held["dra_pool_name"] == node
    # Every family of that GPU carries them, not just one (the XID series too).
    [xid] = [s for s in series(running.agent, "DCGM_FI_DEV_XID_ERRORS") if s["UUID"] == uuid]
    assert xid["pod"] == "trainer"

    unprepare(running, "trainer")
    wait_for("no series labelled with a pod", lambda: not any(
        set(POD_LABELS) & set(s) for s in series(running.agent)), 30, log=running.agent.log)
    assert len(series(running.agent)) == len(gpus)
