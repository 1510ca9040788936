"""The kubelet plugin in the manifests: the RBAC it gets (exactly what it uses), its flags
against the CLI's, and the paths it shares with the agent container and with kubelet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tools import unavailable

from .manifests import by_kind, by_name, container, render
from .tools import ROOT

DRIVER = "gpu.nodeagent.dev"
PLUGIN_SYSTEMD_UNIT = ROOT / "systemd" / "gpu-agent-kubelet-plugin.service"

#: Every (API group, resource) the plugin may touch and exactly the verbs it may use there.
PLUGIN_RBAC = {
    ("resource.k8s.io", "resourceslices"): {"list", "watch", "create", "update", "delete"},
    # get: every prepare; list: the explainer's round (the one plugin holding its Lease).
    ("resource.k8s.io", "resourceclaims"): {"get", "list"},
    ("resource.k8s.io", "resourceclaims/status"): {"patch"},
    # The explainer's Warning Event on a compute-domain claim no clique can hold.
    ("", "events"): {"create"},
    # The API server's per-driver check of status.devices writes (1.36+), own node only.
    ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:patch"},
    # Its Node's UID; its own Node's compute-domain label and membership (patch, narrowed by
    # the admission policy); a domain's member Nodes by label selector (list, watch).
    ("", "nodes"): {"get", "list", "watch", "patch"},
}
#: The rules narrowed to names: (API group, resource) -> the names.
PLUGIN_RESOURCE_NAMES = {("resource.k8s.io", "resourceclaims/driver"): [DRIVER]}
#: The namespaced Role: the explainer's Lease, created, then read and renewed by name.
LEASE_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "resourceNames": ["gpu-node-agent-domain-explainer"], "verbs": ["get", "update"]}]

#: The `gpu-agent kubelet-plugin` flags (the CLI line the plugin and the manifests share);
#: True for the ones without a default.
PLUGIN_FLAGS = {"--agent-socket": True, "--token-file": True, "--node-name": True,
                "--driver": False, "--registry-dir": False, "--plugins-dir": False,
                "--kubeconfig": False, "--health-listen": False, "--agent-lost-after": False,
                "--log-format": False, "--log-level": False}


def _flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as a dict; any other shape fails (one spelling, one flag)."""
    out: dict[str, str] = {}
    for arg in args:
        assert arg.startswith("--") and "=" in arg, f"write {arg!r} as --flag=value"
        name, value = arg.split("=", 1)
        assert name not in out, f"{name} given twice"
        out[name] = value
    return out


def _pod() -> dict[str, Any]:
    ds = by_name(render("daemonset"), "DaemonSet", "gpu-node-agent")
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def _plugin_flags() -> dict[str, str]:
    plugin = container(_pod(), "kubelet-plugin")
    assert plugin["command"] == ["gpu-agent", "kubelet-plugin"]
    return _flags(plugin["args"])


def _mounts(pod: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """A container's mounts by mount path, each with its volume."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: {**m, "volume": volumes[m["name"]]}
            for m in container(pod, name).get("volumeMounts", [])}


def _mount_of(mounts: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The mount that holds ``path`` (the longest mount path above it)."""
    above = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    assert above, f"{path} is on no mount"
    return mounts[max(above, key=len)]


def test_plugin_role_is_exactly_what_it_uses() -> None:
    """The ClusterRole grants the plugin exactly the verbs of the table, on nothing else, and
    is bound to the pod's ServiceAccount."""
    docs = render("daemonset")
    role = by_name(docs, "ClusterRole", "gpu-node-agent-kubelet-plugin")
    granted: dict[tuple[str, str], set[str]] = {}
    named: dict[tuple[str, str], list[str]] = {}
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
                if "resourceNames" in rule:
                    named[(group, resource)] = rule["resourceNames"]
    assert granted == PLUGIN_RBAC
    assert named == PLUGIN_RESOURCE_NAMES
    binding = by_name(docs, "ClusterRoleBinding", "gpu-node-agent-kubelet-plugin")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    account = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert _pod()["serviceAccountName"] == account["metadata"]["name"]


def test_the_lease_role_is_the_explainers_lease_in_the_agents_namespace() -> None:
    """The Role is the explainer's Lease only, in the namespace the plugin's POD_NAMESPACE
    (its --lease-namespace) names, bound to the pod's ServiceAccount."""
    docs = render("daemonset")
    role = by_name(docs, "Role", "gpu-node-agent-kubelet-plugin")
    assert role["rules"] == LEASE_RULES
    account = by_kind(docs, "ServiceAccount")
    assert role["metadata"]["namespace"] == account["metadata"]["namespace"]
    binding = by_name(docs, "RoleBinding", "gpu-node-agent-kubelet-plugin")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    env = {e["name"]: e for e in container(_pod(), "kubelet-plugin")["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath":
                                                              "metadata.namespace"}}


@pytest.mark.parametrize("flags", [
    pytest.param(_plugin_flags, id="daemonset"),
    pytest.param(lambda: _flags([a for a in PLUGIN_SYSTEMD_UNIT.read_text().split(
        "ExecStart=/usr/bin/gpu-agent kubelet-plugin ", 1)[1].split("\n", 1)[0].split()
        if a.startswith("--")]), id="systemd"),
])
def test_plugin_flags_are_the_cli_flags(flags: Any) -> None:
    """The DaemonSet's and the systemd unit's plugin arguments use only flags of the CLI
    line, every required one among them, and this project's driver name."""
    given = flags()
    assert set(given) <= set(PLUGIN_FLAGS), set(given) - set(PLUGIN_FLAGS)
    assert {f for f, required in PLUGIN_FLAGS.items() if required} <= set(given)
    assert given["--driver"] == DRIVER
    assert given["--registry-dir"] == "/var/lib/kubelet/plugins_registry"
    assert given["--plugins-dir"] == "/var/lib/kubelet/plugins"


def test_the_plugin_subcommand_knows_every_flag_the_manifests_use() -> None:
    """`gpu-agent kubelet-plugin --help` lists every flag the DaemonSet passes."""
    gpu_agent = Path(sys.executable).parent / "gpu-agent"
    done = subprocess.run([str(gpu_agent), "kubelet-plugin", "--help"], capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode != 0 and "invalid choice" in done.stderr:
        unavailable("this tree has no `gpu-agent kubelet-plugin` yet (the plugin's branch)")
    assert done.returncode == 0, done.stderr
    for flag in set(_plugin_flags()) | set(PLUGIN_FLAGS):
        assert flag in done.stdout, flag


def test_plugin_and_agent_share_the_socket_and_nothing_secret() -> None:
    """The plugin reaches the agent's Unix socket through the very volume the agent listens
    in; it gets only its own token (mode 0400), never the agent's token file, and the
    Kubernetes API token only the plugin mounts."""
    pod = _pod()
    agent_mounts, plugin_mounts = _mounts(pod, "agent"), _mounts(pod, "kubelet-plugin")
    flags = _plugin_flags()
    agent_args = container(pod, "agent")["args"]
    assert f"--listen=unix:{flags['--agent-socket']}" in agent_args
    socket_dir = str(Path(flags["--agent-socket"]).parent)
    assert _mount_of(agent_mounts, socket_dir)["name"] == _mount_of(plugin_mounts,
                                                                    socket_dir)["name"]
    assert _mount_of(agent_mounts, socket_dir)["mountPath"] == socket_dir

    token = _mount_of(plugin_mounts, flags["--token-file"])
    secret = token["volume"]["secret"]
    assert token["readOnly"] is True and secret["defaultMode"] == 0o400
    assert secret["items"] == [{"key": "kubelet-plugin-token",
                                "path": Path(flags["--token-file"]).name}]
    agent_tokens = next(a.split("=", 1)[1] for a in agent_args if a.startswith("--token-file="))
    agent_secret = _mount_of(agent_mounts, agent_tokens)["volume"]["secret"]
    assert agent_secret["secretName"] == secret["secretName"]
    assert agent_secret["items"] == [{"key": "tokens", "path": Path(agent_tokens).name}]
    assert not {m["name"] for m in plugin_mounts.values()} & {
        m["name"] for m in agent_mounts.values() if "secret" in m["volume"]}

    # The API credential: projected, expiring, for the plugin only; nothing automounted.
    assert pod["automountServiceAccountToken"] is False
    api = plugin_mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
    (token_source,) = [s["serviceAccountToken"] for s in api["volume"]["projected"]["sources"]
                       if "serviceAccountToken" in s]
    assert token_source["path"] == "token" and token_source["expirationSeconds"] <= 3607
    assert api["name"] not in {m["name"] for m in agent_mounts.values()}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" not in agent_mounts


def test_kubelet_directories_are_host_paths_at_the_same_paths() -> None:
    """kubelet dials the socket paths the plugin names, so the registry and the plugin's own
    directory are host paths mounted where they are on the host; only the plugin mounts them,
    and never the other plugins' directories. Of kubelet's directories the agent mounts only
    the PodResources socket's, read-only, at the path its flag names."""
    pod = _pod()
    flags = _plugin_flags()
    plugin_mounts = _mounts(pod, "kubelet-plugin")
    for path in (flags["--registry-dir"], f"{flags['--plugins-dir']}/{DRIVER}"):
        mount = plugin_mounts[path]
        assert mount["volume"]["hostPath"]["path"] == path
        assert not mount.get("readOnly", False)
    assert flags["--plugins-dir"] not in plugin_mounts
    agent_mounts = _mounts(pod, "agent")
    kubelet_paths = {m for m in agent_mounts if m.startswith("/var/lib/kubelet")}
    assert kubelet_paths == {"/var/lib/kubelet/pod-resources"}
    pod_resources = agent_mounts["/var/lib/kubelet/pod-resources"]
    assert pod_resources["readOnly"] is True
    assert pod_resources["volume"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    args = container(pod, "agent")["args"]
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in args


def test_plugin_probes_and_port() -> None:
    """The probes and the Service reach the plugin's health listener, which listens beyond
    loopback in the pod."""
    pod = _pod()
    plugin = container(pod, "kubelet-plugin")
    host, port = _plugin_flags()["--health-listen"].rsplit(":", 1)
    assert host == "0.0.0.0"
    (declared,) = plugin["ports"]
    assert declared["containerPort"] == int(port)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert plugin[probe]["httpGet"] == {"path": path, "port": declared["name"]}
    env = {e["name"]: e for e in plugin["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    docs = render("daemonset")
    service_ports = {p["name"]: p for p in by_kind(docs, "Service")["spec"]["ports"]}
    assert service_ports[declared["name"]]["targetPort"] == declared["name"]
    scraped = {e["port"] for e in by_kind(docs, "ServiceMonitor")["spec"]["endpoints"]}
    assert declared["name"] in scraped


def test_policy_and_classes_name_this_driver_and_service_account() -> None:
    """The admission policies guard the DaemonSet's own ServiceAccount and driver, for every
    write verb (Node updates included), with Deny; every DeviceClass selects this driver's
    devices by `type`."""
    docs = render("daemonset")
    account = by_kind(docs, "ServiceAccount")["metadata"]
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    for name, resource, operations in (
            ("gpu-node-agent-resourceslices", "resourceslices", {"CREATE", "UPDATE", "DELETE"}),
            ("gpu-node-agent-resourceclaim-status", "resourceclaims/status", {"UPDATE"})):
        policy = by_name(docs, "ValidatingAdmissionPolicy", name)
        (condition,) = policy["spec"]["matchConditions"]
        assert condition["expression"] == f'request.userInfo.username == "{user}"'
        (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
        assert rule["resources"] == [resource] and rule["apiVersions"] == ["*"]
        assert set(rule["operations"]) == operations
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert any(f'"{DRIVER}"' in v["expression"] for v in policy["spec"]["validations"])
        binding = by_name(docs, "ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
    nodes = by_name(docs, "ValidatingAdmissionPolicy", "gpu-node-agent-node-metadata")
    (condition,) = nodes["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    (rule,) = nodes["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["nodes"], ["UPDATE"])
    assert nodes["spec"]["failurePolicy"] == "Fail"
    assert by_name(docs, "ValidatingAdmissionPolicyBinding", "gpu-node-agent-node-metadata")[
        "spec"] == {"policyName": "gpu-node-agent-node-metadata", "validationActions": ["Deny"]}
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    assert {c["metadata"]["name"] for c in classes} == {
        f"gpu.{DRIVER.split('.', 1)[1]}", f"mig.{DRIVER.split('.', 1)[1]}",
        f"dynamic-mig.{DRIVER.split('.', 1)[1]}", f"share.{DRIVER.split('.', 1)[1]}",
        f"compute-domain.{DRIVER}"}
    for cls in classes:
        (selector,) = cls["spec"]["selectors"]
        expression = selector["cel"]["expression"]
        assert expression.startswith(f'device.driver == "{DRIVER}" &&')
        # The share class selects what is published shareable, whatever its type.
        selects = "shareable" if cls["metadata"]["name"].startswith("share.") else "type"
        assert f'device.attributes["{DRIVER}"].{selects} == ' in expression


def test_the_node_bound_credential_is_renewed_where_the_install_put_it() -> None:
    """docs/kubernetes.md's "Renewing a Node-bound credential" writes the token into the file
    the systemd unit passes as --kubeconfig, for the user the bare-metal install made, and
    makes it for the ServiceAccount and namespace the manifests bind the plugin's role to."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    renewing = " ".join(text.split("## Renewing a Node-bound credential", 1)[1]
                        .replace("\\\n", " ").split())
    unit = PLUGIN_SYSTEMD_UNIT.read_text().split(
        "ExecStart=/usr/bin/gpu-agent kubelet-plugin ", 1)[1].split("\n", 1)[0]
    kubeconfig = _flags([a for a in unit.split() if a.startswith("--")])["--kubeconfig"]
    assert f"--kubeconfig={kubeconfig} set-credentials" in renewing
    installed = next(line for line in text.splitlines()
                     if "set-credentials" in line and "$KC" in line)
    user = installed.split("set-credentials", 1)[1].split()[0]
    assert f"set-credentials {user} " in renewing
    account = by_kind(render("daemonset"), "ServiceAccount")["metadata"]
    assert (f"kubectl -n {account['namespace']} create token {account['name']} "
            "--duration=720h --bound-object-kind=Node") in renewing


def test_the_readiness_probe_waits_longer_than_a_check() -> None:
    """Each /readyz check is bounded (a refused credential's check included), and the probe
    waits longer than that bound: a slow dependency is a reason, not a probe timeout."""
    from agent.kubeplugin.health import CHECK_TIMEOUT_S  # noqa: PLC0415 - the optional extra

    plugin = container(_pod(), "kubelet-plugin")
    assert plugin["readinessProbe"]["timeoutSeconds"] > CHECK_TIMEOUT_S
