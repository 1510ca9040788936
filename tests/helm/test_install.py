"""``helm install``, ``helm upgrade`` and ``helm uninstall`` of the chart against a real
kube-apiserver (tests/k8s), with the agent and the kubelet plugin then run as kubelet would run
the DaemonSet's pod (tests/helm/pod.py: the pod template as the server stored it, the chart's
Secrets, a token of the chart's ServiceAccount under the chart's RBAC and admission policies)
and kubelet's DRA manager (the kubelet harness) preparing a claim through them.

The previous chart version is this chart as 0.1.0 (version, appVersion and so the default
image tag): no chart was released before 0.2.0, so the upgrade checked is what any two
releases of this chart differ by, the image, with everything the running pods depend on
(selectors, host paths, Secrets) kept."""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.helm import CHART, run
from tests.helm.pod import NodePod, PodAgent
from tests.k8s.fixtures import DRA_GATES
from tests.k8s.harness import NEWEST, ApiServer, KubeletHarness, allocate_in_cluster
from tests.k8s.objects import claim, pod
from tests.k8s.stack import PluginProcess, server_slices, wait_for

NAMESPACE = "gpu-node-agent"
RELEASE = "gpu-node-agent"
NODE = "helm-node"
PRESET = "l40s"
CRDS = Path(__file__).resolve().parents[1] / "deploy" / "crds"
Json = dict[str, Any]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ApiServer]:
    """An API server of this test's own (the chart's cluster-scoped objects and its admission
    policy would meet other tests' on a shared one), with the Prometheus Operator's CRDs
    (trimmed copies, tests/deploy/crds) so the chart's monitoring objects install too, and the
    release namespace made as docs/deploy.md says."""
    # Privileged containers allowed, as every cluster running GPU agents does.
    started = ApiServer.start(NEWEST, tmp_path / "apiserver", feature_gates=DRA_GATES[NEWEST],
                              extra=("--allow-privileged=true",))
    try:
        for name in ("servicemonitors.yaml", "prometheusrules.yaml"):
            started.kubectl("apply", "-f", str(CRDS / name))
        started.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        "crd/servicemonitors.monitoring.coreos.com",
                        "crd/prometheusrules.monitoring.coreos.com")
        started.kubectl("create", "namespace", NAMESPACE)
        started.kubectl("label", "namespace", NAMESPACE,
                        *(f"pod-security.kubernetes.io/{m}=privileged"
                          for m in ("enforce", "audit", "warn")))
        started.ensure_node(NODE)
        yield started
    finally:
        started.stop()


@pytest.fixture
def node_root() -> Iterator[Path]:
    """The node's directories: short, for the Unix sockets' 107-byte addresses."""
    root = Path(tempfile.mkdtemp(prefix="helm-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def previous_chart(directory: Path) -> Path:
    """This chart as version 0.1.0."""
    chart = directory / "gpu-node-agent-0.1.0"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta.update(version="0.1.0", appVersion="0.1.0")
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return chart


def helm(server: ApiServer, home: Path, *args: str) -> str:
    done = run(home, *args, "--namespace", NAMESPACE, kubeconfig=server.kubeconfig,
               timeout=180)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def release(server: ApiServer, home: Path) -> Json:
    """The release as ``helm list`` reports it."""
    (found,) = json.loads(helm(server, home, "list", "--output", "json"))
    return dict(found)


def manifest_objects(server: ApiServer, home: Path) -> list[tuple[str, str]]:
    """(kind, name) of every object of the release's manifest, read back from the server."""
    manifest = helm(server, home, "get", "manifest", RELEASE)
    listed = json.loads(server.kubectl("get", "-f", "-", "-o", "json", stdin=manifest).stdout)
    items = listed["items"] if listed.get("kind") == "List" else [listed]
    return sorted((i["kind"], i["metadata"]["name"]) for i in items)


def secret_data(server: ApiServer, name: str) -> dict[str, str]:
    status, body = server.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}")
    assert status == 200, body
    return {k: base64.b64decode(v).decode() for k, v in body["data"].items()}


def daemonset_image(server: ApiServer) -> set[str]:
    status, ds = server.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/"
                                       "gpu-node-agent")
    assert status == 200, ds
    return {c["image"] for c in ds["spec"]["template"]["spec"]["containers"]}


class Node:
    """The node: kubelet's DRA manager, and the DaemonSet's current pod on it."""

    def __init__(self, server: ApiServer, root: Path) -> None:
        self.server = server
        self.root = root
        host = root / "host"
        # kubelet's root is the host's /var/lib/kubelet: the plugin's registry and plugin
        # directories (host paths of the pod) are kubelet's own.
        self.kubelet = KubeletHarness(NEWEST, server, node=NODE, root=host / "var/lib/kubelet")
        self.pod: NodePod | None = None
        self.agent: PodAgent | None = None
        self.plugin: PluginProcess | None = None

    def start_pod(self) -> None:
        """What the DaemonSet controller and kubelet do for a new pod: the Pod from the
        stored template, its volumes, the agent, then the plugin registered and ready."""
        self.pod = NodePod(self.server, NAMESPACE, "gpu-node-agent", NODE, self.root)
        admin = secret_data(self.server, "gpu-node-agent-tokens")["admin-token"]
        self.agent = self.pod.start_agent(preset=PRESET, admin_token=admin)
        self.plugin = self.pod.start_plugin()
        self.plugin.wait_ready(60)

    def stop_pod(self) -> None:
        assert self.pod is not None
        self.pod.stop()

    def claims(self) -> list[Json]:
        """The claims the agent holds (over its socket, with the chart's admin token)."""
        assert self.agent is not None
        reply = self.agent.request("GET", "/v1/claims", unix=True)
        assert reply.status == 200, reply.body
        return list(reply.body["claims"])

    def prepare(self, name: str) -> Json:
        """A Pod on the node with a claim for a whole GPU (the chart's DeviceClass),
        allocated as the scheduler does, prepared through kubelet; the agent's claim."""
        made = claim(name)
        del made["metadata"]["uid"]  # the server's to give
        self.server.apply([made, pod(name, {"gpu": name}, node_name=NODE)])
        wait_for("slices of the node", lambda: server_slices(self.server, NODE), 30,
                 log=self.plugin.log if self.plugin else None)
        answer = allocate_in_cluster(self.server, node=NODE, claims=[f"default/{name}"],
                                     pod=f"default/{name}")
        assert answer.allocated, answer.reason
        prepared = self.kubelet.prepare(f"default/{name}")
        assert prepared["ok"], f"{prepared}\n{self.plugin.log() if self.plugin else ''}"
        status, stored = self.server.request(
            "GET", f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}")
        assert status == 200, stored
        (held,) = [c for c in self.claims() if c["uid"] == stored["metadata"]["uid"]]
        assert held["state"] == "prepare_completed", held
        return held

    def held(self) -> list[tuple[str, str]]:
        """(uid, state) of each claim the agent holds."""
        return [(c["uid"], c["state"]) for c in self.claims()]

    def close(self) -> None:
        if self.pod is not None:
            self.pod.stop()
        self.kubelet.close()


def cdi_spec_on_host(node_root: Path, held: Json) -> Path:
    """The claim's CDI spec in the node's /var/run/cdi (the agent names it by the path it
    sees through the container's mount)."""
    path = node_root / "host" / "var/run/cdi" / Path(held["cdi_spec"]).name
    assert path.is_file(), f"{path} missing"
    return path


def test_install_then_upgrade_keeps_a_prepared_claim(server: ApiServer, node_root: Path,
                                                     tmp_path: Path) -> None:
    """``helm install`` of the previous chart creates every object and an agent and plugin
    run from its pod template publish slices and prepare a claim; ``helm upgrade`` to this
    chart changes the image, keeps the Secrets, and after agent and plugin restart from the
    upgraded template the claim is still prepared: its CDI spec on disk, the agent lists it,
    kubelet's unprepare succeeds."""
    home = tmp_path / "helm-home"
    helm(server, home, "install", RELEASE, str(previous_chart(tmp_path)))
    assert (release(server, home)["chart"], release(server, home)["status"]) == (
        "gpu-node-agent-0.1.0", "deployed")
    objects = manifest_objects(server, home)
    assert ("DaemonSet", "gpu-node-agent") in objects and ("Secret", "gpu-node-agent-tokens") \
        in objects and ("ServiceMonitor", "gpu-node-agent") in objects, objects
    assert len(objects) == 24, objects
    assert daemonset_image(server) == {"ghcr.io/gpu-node-agent/gpu-node-agent:0.1.0"}
    tokens, tls = secret_data(server, "gpu-node-agent-tokens"), secret_data(
        server, "gpu-node-agent-tls")

    node = Node(server, node_root)
    try:
        node.start_pod()
        held = node.prepare("before-upgrade")
        spec = cdi_spec_on_host(node_root, held)
        assert release(server, home)["app_version"] == "0.1.0"

        helm(server, home, "upgrade", RELEASE, str(CHART))
        assert (release(server, home)["chart"], release(server, home)["revision"]) == (
            "gpu-node-agent-0.2.0", "2")
        assert daemonset_image(server) == {"ghcr.io/gpu-node-agent/gpu-node-agent:0.2.0"}
        assert manifest_objects(server, home) == objects
        # The running pods' credentials: an upgrade that made new ones would lock the
        # plugin out of the agent until both restarted.
        assert secret_data(server, "gpu-node-agent-tokens") == tokens
        assert secret_data(server, "gpu-node-agent-tls") == tls

        node.stop_pod()  # the rolling update: the old pod ends, a new one starts
        node.start_pod()
        assert spec.is_file()
        assert node.held() == [(held["uid"], "prepare_completed")]
        unprepared = node.kubelet.unprepare("default/before-upgrade")
        assert unprepared["ok"], unprepared
        assert node.claims() == [] and not spec.exists()
    finally:
        node.close()


def test_uninstall_leaves_prepared_claims_on_the_node(server: ApiServer, node_root: Path,
                                                      tmp_path: Path) -> None:
    """``helm uninstall`` deletes the chart's objects (DaemonSets, Secrets, DeviceClasses,
    RBAC, policies) but not the node's host paths: a claim prepared before it keeps its CDI
    spec (its containers keep their GPUs), and after a new install the agent, from the same
    state directory, still holds it and kubelet can unprepare it."""
    home = tmp_path / "helm-home"
    helm(server, home, "install", RELEASE, str(CHART))
    node = Node(server, node_root)
    try:
        node.start_pod()
        held = node.prepare("across-uninstall")
        spec = cdi_spec_on_host(node_root, held)

        helm(server, home, "uninstall", RELEASE)
        node.stop_pod()  # its DaemonSet is gone: the pod is deleted
        for path in ("/apis/apps/v1/namespaces/gpu-node-agent/daemonsets/gpu-node-agent",
                     "/api/v1/namespaces/gpu-node-agent/secrets/gpu-node-agent-tokens",
                     "/apis/resource.k8s.io/v1/deviceclasses/gpu.nodeagent.dev",
                     "/apis/rbac.authorization.k8s.io/v1/clusterroles/"
                     "gpu-node-agent-kubelet-plugin"):
            assert server.request("GET", path)[0] == 404, path
        assert spec.is_file()

        helm(server, home, "install", RELEASE, str(CHART))
        node.start_pod()
        assert node.held() == [(held["uid"], "prepare_completed")]
        unprepared = node.kubelet.unprepare("default/across-uninstall")
        assert unprepared["ok"], unprepared
        assert node.claims() == [] and not spec.exists()
    finally:
        node.close()
