"""The MPS host's DaemonSet and its OpenShift overlay: a pod of its own that agent rollouts
never touch, on the same host paths and binary as the agent."""

from __future__ import annotations

from typing import Any

import pytest

from .manifests import by_kind, by_name, container, render
from .tools import ROOT

HOST = "gpu-node-agent-mps-host"


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def _pods(tree: str) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = render(tree)
    agent = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    host = by_name(docs, "DaemonSet", HOST)["spec"]["template"]["spec"]
    return agent, host


def _host_path_at(pod: dict[str, Any], container_name: str, path: str) -> str:
    """The host path that ``path`` in the container is (its mount's volume, same layout)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = container(pod, container_name)["volumeMounts"]
    (mount,) = [m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")]
    source = volumes[mount["name"]]["hostPath"]["path"]
    return source + path[len(mount["mountPath"]):]


def test_the_host_is_a_daemonset_of_its_own_that_rollouts_never_restart() -> None:
    """Its own DaemonSet with OnDelete (applying a new version restarts nothing), privileged
    with host PIDs, never restarted by a probe, no memory limit over its daemons' servers,
    ready when it answers on its socket, and no API credential."""
    ds = by_name(render("daemonset"), "DaemonSet", HOST)
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    pod = ds["spec"]["template"]["spec"]
    host = container(pod, "mps-host")
    assert [c["name"] for c in pod["containers"]] == ["mps-host"]
    assert pod["hostPID"] is True and host["securityContext"]["privileged"] is True
    assert "livenessProbe" not in host
    assert "limits" not in host["resources"]
    assert host["readinessProbe"]["exec"]["command"][:3] == ["gpu-agent", "mps-host",
                                                             f"--socket={_flags(host['args'])['--socket']}"]
    assert host["readinessProbe"]["exec"]["command"][3:] == ["--ping"]
    assert host["command"] == ["gpu-agent", "mps-host"] and "--private-shm" in host["args"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("tree", ["daemonset", "daemonset/overlays/openshift"])
def test_agent_and_host_agree_on_socket_root_and_binary_by_host_path(tree: str) -> None:
    """The agent's --mps-host-socket, --mps-root and --mps-control are the host's --socket,
    --mps-root and --mps-control, and both containers see them at the same host paths (the
    CDI specs mount pipe directories into pods by host path)."""
    agent_pod, host_pod = _pods(tree)
    agent = _flags(container(agent_pod, "agent")["args"])
    host = _flags(container(host_pod, "mps-host")["args"])
    assert agent["--mps-host-socket"] == host["--socket"]
    assert agent["--mps-root"] == host["--mps-root"]
    assert agent["--mps-control"] == host["--mps-control"]
    for path in (host["--socket"], host["--mps-root"] + "/x", host["--mps-control"]):
        on_host = _host_path_at(host_pod, "mps-host", path)
        assert on_host == _host_path_at(agent_pod, "agent", path) == path


def test_openshift_labels_pipe_directories_and_admits_the_host() -> None:
    """On OpenShift the host labels each daemon's pipe and shm directories container_file_t
    at s0 (every pod's categories dominate it), the SCC bound to its ServiceAccount admits
    its pod, and the policy module for the spc_t sockets ships beside the overlay."""
    docs = render("daemonset/overlays/openshift")
    scc = by_kind(docs, "SecurityContextConstraints")
    ds = by_name(docs, "DaemonSet", HOST)
    pod = ds["spec"]["template"]["spec"]
    host = container(pod, "mps-host")
    assert _flags(host["args"])["--selinux-context"] == "system_u:object_r:container_file_t:s0"
    account = pod["serviceAccountName"]
    assert scc["users"] == [f"system:serviceaccount:gpu-node-agent:{account}"]
    assert scc["allowPrivilegedContainer"] is True and scc["allowHostPID"] is True
    assert {k for v in pod["volumes"] for k in v if k != "name"} <= set(scc["volumes"])
    module = (ROOT / "daemonset/overlays/openshift/mps-selinux.te").read_text()
    assert "allow container_t spc_t:unix_stream_socket { read write };" in module


@pytest.mark.parametrize("tree", ["daemonset", "daemonset/overlays/openshift"])
def test_the_host_starts_the_agent_s_imex_daemon_on_the_node_s_network(tree: str) -> None:
    """The host's --imex is the binary the agent runs (its driver root's nvidia-imex), its
    --imex-root is the agent's <state dir>/imex at the same host path (and no more of the
    agent's state), and its pod uses the node's network: the daemon listens on the node's
    address, the agent's --imex-address (the node's hostIP)."""
    agent_pod, host_pod = _pods(tree)
    agent = _flags(container(agent_pod, "agent")["args"])
    host = _flags(container(host_pod, "mps-host")["args"])
    assert host["--imex"] == agent["--driver-root"].rstrip("/") + "/usr/bin/nvidia-imex"
    assert host["--imex-root"] == agent["--state-dir"] + "/imex"
    config = host["--imex-root"] + "/config.cfg"
    assert _host_path_at(host_pod, "mps-host", config) == \
        _host_path_at(agent_pod, "agent", config) == config
    volumes = {v["name"]: v for v in host_pod["volumes"]}
    assert not any(v.get("hostPath", {}).get("path") == agent["--state-dir"]
                   for v in volumes.values())
    assert host_pod["hostNetwork"] is True
    env = {e["name"]: e for e in container(agent_pod, "agent")["env"]}
    assert env["GPU_AGENT_IMEX_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    if tree.endswith("openshift"):
        assert by_kind(render(tree), "SecurityContextConstraints")["allowHostNetwork"] is True
