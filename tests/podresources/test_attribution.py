"""Pod labels on the agent's DCGM series from a kubelet PodResources server (here a gRPC
server on a Unix socket answering what kubelet answers), through the agent's own wiring
(``--pod-resources-socket``): the client, the poller, the collector. tests/k8s/
test_pod_attribution.py does the same against kubelet's own server code."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.errors import InvalidRequest
from agent.podresources.poller import KEEP_INTERVALS
from agent.podresources.proto import podresources_v1_pb2 as pb
from agent.podresources.proto import podresources_v1_pb2_grpc as pb_grpc
from agent.settings import resolve
from tests.metrics.textformat import parse
from tests.service_node import ServiceNode, open_services

DRIVER = "gpu.nodeagent.dev"
FIELD = "DCGM_FI_DEV_POWER_USAGE"


class Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """Answers List with ``pods``; ``fail`` makes it answer UNAVAILABLE."""

    def __init__(self) -> None:
        self.pods: list[Any] = []
        self.fail = False
        self.calls = 0

    async def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")
        return pb.ListPodResourcesResponse(pod_resources=self.pods)


def _pod(namespace: str, name: str, containers: list[Any]) -> Any:
    return pb.PodResources(name=name, namespace=namespace, containers=containers)


def _plugin_container(name: str, *ids: str) -> Any:
    return pb.ContainerResources(name=name, devices=[pb.ContainerDevices(
        resource_name="nvidia.com/gpu", device_ids=list(ids))])


def _dra_container(name: str, claim: str, device: str) -> Any:
    return pb.ContainerResources(name=name, dynamic_resources=[pb.DynamicResource(
        claim_name=claim, claim_namespace="ml", claim_resources=[pb.ClaimResource(
            driver_name=DRIVER, pool_name="node-a", device_name=device,
            cdi_devices=[pb.CDIDevice(name=f"k8s.{DRIVER}/claim={claim}")])])])


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))  # short: a socket address
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[Kubelet]:
    servicer = Kubelet()
    server = grpc.aio.server()
    pb_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket_dir / 'kubelet.sock'}")
    await server.start()
    yield servicer
    await server.stop(None)


@pytest.fixture
async def node(tmp_path: Path, socket_dir: Path, kubelet: Kubelet) -> AsyncIterator[ServiceNode]:
    started = await open_services(tmp_path, settings={
        "pod_resources_socket": socket_dir / "kubelet.sock"})
    yield started
    await started.close()


def _series(node: ServiceNode) -> list[dict[str, str]]:
    text = node.node.collector.collect().block.text.decode()
    return [s.labels for s in parse(text).named(FIELD)]


def _pods(series: list[dict[str, str]], gpu: str) -> list[tuple[str, str, str]]:
    return [(s.get("namespace", ""), s.get("pod", ""), s.get("container", ""))
            for s in series if s["gpu"] == gpu]


async def test_held_devices_carry_each_holders_pod_labels(node: ServiceNode,
                                                          kubelet: Kubelet) -> None:
    """A GPU a device plugin gave one container has one series with that pod's labels; a
    GPU two containers share through a DRA claim has one series per container, each also
    naming the claim and the device; every other GPU has one series and no pod labels."""
    gpu1 = (await node.gpu(1)).uuid
    kubelet.pods = [
        _pod("ml", "trainer", [_plugin_container("main", gpu1)]),
        _pod("ml", "server", [_dra_container("api", "shared", "gpu-2"),
                              _dra_container("sidecar", "shared", "gpu-2")]),
    ]
    assert node.node.pods is not None and await node.node.pods.poll()
    series = _series(node)

    assert _pods(series, "1") == [("ml", "trainer", "main")]
    assert _pods(series, "2") == [("ml", "server", "api"), ("ml", "server", "sidecar")]
    [api, _] = [s for s in series if s["gpu"] == "2"]
    assert {k: api[k] for k in api if k.startswith("dra_")} == {
        "dra_claim_name": "shared", "dra_claim_namespace": "ml", "dra_driver_name": DRIVER,
        "dra_pool_name": "node-a", "dra_device_name": "gpu-2"}
    others = [s for s in series if s["gpu"] not in ("1", "2")]
    assert len(others) == 6 and not any("pod" in s for s in others)


async def test_a_failing_kubelet_keeps_the_last_answer_briefly_then_drops_it(
        node: ServiceNode, kubelet: Kubelet) -> None:
    """When kubelet stops answering, collections go on and keep the last answer for
    KEEP_INTERVALS - 1 failed polls; at the KEEP_INTERVALS-th the pod labels go, and each
    failure is counted; kubelet answering again brings them back."""
    pods = node.node.pods
    assert pods is not None
    kubelet.pods = [_pod("ml", "trainer", [_plugin_container("main", (await node.gpu(0)).uuid)])]
    assert await pods.poll()
    kubelet.fail = True
    registry = node.node.metrics.registry

    def errors() -> float:
        return registry.get_sample_value("gpu_agent_podresources_errors_total") or 0.0

    before = errors()
    for _ in range(KEEP_INTERVALS - 1):
        assert not await pods.poll()
        assert _pods(_series(node), "0") == [("ml", "trainer", "main")]
    assert not await pods.poll()
    assert _pods(_series(node), "0") == [("", "", "")]
    assert errors() - before == KEEP_INTERVALS

    kubelet.fail = False
    assert await pods.poll()
    assert _pods(_series(node), "0") == [("ml", "trainer", "main")]


def test_the_flag_without_grpcio_is_a_clear_start_up_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--pod-resources-socket without grpcio installed refuses to start, naming the flag and
    the extra to install, rather than serving metrics without pod labels."""
    import importlib.util  # noqa: PLC0415 - patched here only

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "grpc" else real(name, *a))
    with pytest.raises(InvalidRequest) as raised:
        resolve({"simulate": "dgx-h100", "state_dir": tmp_path,
                 "pod_resources_socket": "/var/lib/kubelet/pod-resources/kubelet.sock"},
                env={})
    assert "gpu-node-agent[kubernetes]" in raised.value.detail
    assert "--pod-resources-socket" in raised.value.detail
