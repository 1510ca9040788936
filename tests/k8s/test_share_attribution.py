"""Per-share memory attribution with real Kubernetes (issue 23): two pods, each with a claim
of 10Gi of one L40S (``--gpu-shares``), prepared by kubelet's DRA manager through the plugin
and the agent; with kubelet's own PodResources server answering the agent, the GPU is served
as one DCGM series per share, each labelled with its pod and its claim, whose framebuffer used
is what that share's MPS clients use."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess
from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.harness import VERSIONS
from tests.k8s.published import gpu_uuid
from tests.k8s.stack import StartStack, wait_for
from tests.k8s.test_shares import start_pods
from tests.k8s.workload import allocate as allocate_pod
from tests.k8s.workload import claim_uid, unprepare
from tests.metrics.textformat import parse


def fb_used(agent: AgentProcess, uuid: str) -> list[tuple[dict[str, str], float]]:
    """GPU ``uuid``'s DCGM_FI_DEV_FB_USED series: labels and value."""
    reply = agent.request("GET", "/metrics")
    assert reply.status == 200, reply.body
    text = reply.body if isinstance(reply.body, str) else reply.body.decode()
    return [(s.labels, s.value) for s in parse(text).named("DCGM_FI_DEV_FB_USED")
            if s.labels["UUID"] == uuid]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for the agent's link to kubelet's PodResources socket."""
    path = Path(tempfile.mkdtemp(prefix="podres-share-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_share_of_a_gpu_is_attributed_to_its_pod_with_its_own_memory(
        version: str, kube_apiservers: StartApiServer, stack: StartStack,
        socket_dir: Path) -> None:
    """share-attr-0's MPS client uses 3000 MiB and share-attr-1's 5000 MiB: GPU 0's FB_USED has
    one series per pod, share-attr-0's 3000 and share-attr-1's 5000, each with its pod,
    container and claim UID; after both unprepare, GPU 0 has its one unattributed series again."""
    gates = DRA_GATES[version]
    server = kube_apiservers(version)
    link = socket_dir / "kubelet.sock"
    running = stack(server, "l40s", node=f"share-attr-{version}".replace(".", "-"),
                    agent_extra=["--gpu-shares", "--pod-resources-socket", str(link),
                                 "--collect-interval", "0.2"], kubelet_gates=gates)
    assert running.kubelet is not None
    link.symlink_to(running.kubelet.pod_resources_socket)
    uuid = gpu_uuid(running.agent, 0)
    names = start_pods(running, "10Gi", uuid, 2, prefix="share-attr")
    for name in names:
        answer = allocate_pod(running, name, feature_gates=gates)
        assert answer.allocated, answer.reason
        prepared = running.kubelet.prepare(f"default/{name}")
        assert prepared["ok"], f"{prepared}\n{running.plugin.log()}"
    used = dict(zip(names, (3000, 5000), strict=True))
    for name in names:
        claim = running.agent.request("GET", f"/v1/claims/{claim_uid(running, name)}").body
        added = running.agent.request("POST", "/v1/sim/processes", {
            "device": uuid, "used_memory_mib": used[name],
            "mps_pipe_directory": claim["mps"]["pipe_directory"]})
        assert added.status in (200, 201), added.body

    expected = {name: (used[name], claim_uid(running, name), "main") for name in names}
    seen: list[object] = []

    def per_pod() -> bool:
        # The series converge as the collector meets each process and its pod (a scrape
        # between two collections may show one attributed and one not yet).
        found = fb_used(running.agent, uuid)
        shown = {labels.get("pod", ""): (value, labels.get("claim_uid", ""),
                                         labels.get("container", ""))
                 for labels, value in found}
        seen[:] = [found]
        return len(found) == 2 and shown == expected

    try:
        wait_for(f"GPU 0's framebuffer per pod: {expected}", per_pod, 30)
    except AssertionError as err:
        raise AssertionError(f"{err}\nlast seen: {seen}\n{running.agent.log()[-4000:]}") \
            from None

    for name in names:
        unprepare(running, name)
    wait_for("GPU 0's one series without a pod", lambda: [
        labels for labels, _ in fb_used(running.agent, uuid) if "pod" not in labels] == [
        labels for labels, _ in fb_used(running.agent, uuid)], 30, log=running.agent.log)
