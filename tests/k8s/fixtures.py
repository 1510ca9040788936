"""pytest fixtures over tests/k8s/harness.py. tests/k8s/conftest.py imports them; another
test package uses them by importing the names it needs into its own conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.k8s.harness import NEWEST, ApiServer, DeviceTaintEviction, KubeletHarness

# Gates the tests need on servers where they are not on by default (1.34: alpha or beta-off);
# the newest server runs with its defaults.
DRA_GATES = {
    "1.34": "DRAPartitionableDevices=true,DRADeviceTaints=true,DRAConsumableCapacity=true",
    "1.37": "",
}

StartApiServer = Callable[..., ApiServer]
StartKubelet = Callable[..., KubeletHarness]
StartEviction = Callable[..., DeviceTaintEviction]


@pytest.fixture(scope="session")
def kube_apiservers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartApiServer]:
    """``start(version, feature_gates=DRA_GATES[version], extra=())``: one shared API server
    per (version, gates, extra kube-apiserver flags) for the session, started on first use."""
    running: dict[tuple[str, str, tuple[str, ...]], ApiServer] = {}

    def start(version: str = NEWEST, feature_gates: str | None = None,
              extra: tuple[str, ...] = ()) -> ApiServer:
        gates = DRA_GATES[version] if feature_gates is None else feature_gates
        key = (version, gates, tuple(extra))
        if key not in running:
            directory = tmp_path_factory.mktemp(f"apiserver-{version}")
            running[key] = ApiServer.start(version, directory, feature_gates=gates,
                                           extra=extra)
        return running[key]

    yield start
    for server in running.values():
        server.stop()


@pytest.fixture(scope="session")
def kube_apiserver(kube_apiservers: StartApiServer) -> ApiServer:
    """The newest supported kube-apiserver (with etcd), shared by the session: ``.url``,
    ``.kubeconfig`` (admin), ``.kubectl(...)``, ``.request(...)``,
    ``.service_account_kubeconfig(ns, name, path)``, ``.ensure_node(name)``."""
    return kube_apiservers(NEWEST)


@pytest.fixture
def kubelet_harness(tmp_path: Path) -> Iterator[StartKubelet]:
    """``start(server, node=..., version=server.version)``: kubelet's DRA manager and plugin
    watcher (registry dir ``.registry_dir``), stopped at the end of the test."""
    started: list[KubeletHarness] = []

    def start(server: ApiServer, *, node: str, version: str | None = None,
              feature_gates: str = "", kubeconfig: Path | None = None) -> KubeletHarness:
        harness = KubeletHarness(version or server.version, server, node=node,
                                 root=tmp_path / f"kubelet-{len(started)}",
                                 feature_gates=feature_gates, kubeconfig=kubeconfig)
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.close()


@pytest.fixture
def device_taint_eviction(tmp_path: Path) -> Iterator[StartEviction]:
    """``start(server, feature_gates=DRA_GATES[server.version])``: kube-controller-manager's
    device taint eviction controller watching ``server`` (``.log()``), stopped at the end of
    the test. Its gates are the server's: kube-controller-manager runs with the cluster's."""
    started: list[DeviceTaintEviction] = []

    def start(server: ApiServer, *, feature_gates: str | None = None) -> DeviceTaintEviction:
        gates = DRA_GATES[server.version] if feature_gates is None else feature_gates
        controller = DeviceTaintEviction(server, root=tmp_path / f"eviction-{len(started)}",
                                         feature_gates=gates)
        started.append(controller)
        return controller

    yield start
    for controller in started:
        controller.close()
