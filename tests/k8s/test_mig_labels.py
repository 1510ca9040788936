"""mig-manager's node labels against a real kube-apiserver and a real simulated agent: the real
``gpu-agent kubelet-plugin`` process, under the RBAC of daemonset/overlays/mig-manager (the
base ClusterRole plus the overlay's roles, through a ServiceAccount token), follows its
Node's ``nvidia.com/mig.config`` label and reports ``nvidia.com/mig.config.state``."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.agent_process import AgentProcess
from tests.deploy.manifests import by_name, render
from tests.k8s.conftest import StartAgent
from tests.k8s.harness import ApiServer
from tests.waiting import wait_for

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"

ALL_ENABLED = "  all-enabled:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n"
BALANCED = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}


def config_yaml(custom: dict[str, int], *, extra: str = "") -> str:
    """A config in the GPU Operator's default-mig-parted-config style (device filter on the
    H100 for all-balanced), with a ``custom`` label the tests edit."""
    devices = "\n".join(f'        "{p}": {n}' for p, n in custom.items())
    return f"""version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-balanced:
    - device-filter: ["0x233010DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1
  custom:
    - devices: all
      mig-enabled: true
      mig-devices:
{devices}
{extra}"""


#: The shipped bindings and admission policies name this account; applied as rendered.
PLUGIN_NAMESPACE = PLUGIN_ACCOUNT = "gpu-node-agent"
#: What the test takes from the rendered overlay (not the DaemonSet: no kubelet runs it).
ACCESS_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@dataclass(frozen=True)
class Account:
    """The overlay's access objects on the server, and the ConfigMap its Role names."""

    server: ApiServer
    namespace: str
    config_map: str

    def kubeconfig(self, node: str, path: Path) -> Path:
        """A kubeconfig (mode 0600) with a token of the plugin's ServiceAccount bound to a
        Pod on ``node``, as the DaemonSet's projected token is (the API server then names
        the node in the token, which both admission policies check)."""
        pods = f"/api/v1/namespaces/{PLUGIN_NAMESPACE}/pods"
        pod = f"kubelet-plugin-{node}"
        status, body = self.server.request("GET", f"{pods}/{pod}")
        if status == 404:
            status, body = self.server.request("POST", pods, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": PLUGIN_NAMESPACE},
                "spec": {"nodeName": node, "serviceAccountName": PLUGIN_ACCOUNT,
                         "containers": [{"name": "kubelet-plugin",
                                         "image": "registry.invalid/gpu-node-agent"}]}})
        assert status in (200, 201), body
        token = self.server.kubectl(
            "create", "token", "-n", PLUGIN_NAMESPACE, PLUGIN_ACCOUNT,
            "--bound-object-kind", "Pod", "--bound-object-name", pod,
            "--bound-object-uid", body["metadata"]["uid"], "--duration=1h").stdout.strip()
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "harness", "cluster": {
                "server": self.server.url, "certificate-authority": str(self.server.ca)}}],
            "users": [{"name": "plugin", "user": {"token": token}}],
            "contexts": [{"name": "plugin", "context": {"cluster": "harness",
                                                        "user": "plugin"}}],
            "current-context": "plugin"}))
        path.chmod(0o600)
        return path


def _ensure_namespace(server: ApiServer, name: str) -> None:
    if server.kubectl("get", "namespace", name, check=False).returncode != 0:
        server.kubectl("create", "namespace", name)


def apply_access(server: ApiServer) -> None:
    """The overlay's RBAC and admission policies, as rendered."""
    docs = render("daemonset/overlays/mig-manager")
    body = {"apiVersion": "v1", "kind": "List",
            "items": [doc for doc in docs if doc["kind"] in ACCESS_KINDS]}
    server.kubectl("apply", "-f", "-", stdin=json.dumps(body))


@pytest.fixture(autouse=True)
def overlay_node_policy(kube_apiserver: ApiServer) -> None:
    """The overlay's Node policy again before each test: a stack started on the shared server
    by another module applies the base's, which has no state label (one policy, one name)."""
    apply_access(kube_apiserver)


@pytest.fixture(scope="module")
def account(kube_apiserver: ApiServer) -> Account:
    """daemonset/overlays/mig-manager's RBAC and admission policies (the base's included)
    applied as rendered, and the ServiceAccount they name."""
    docs = render("daemonset/overlays/mig-manager")
    role = by_name(docs, "Role", "gpu-node-agent-mig-config")
    (config_map,) = role["rules"][0]["resourceNames"]
    for namespace in (PLUGIN_NAMESPACE, role["metadata"]["namespace"]):
        _ensure_namespace(kube_apiserver, namespace)
    apply_access(kube_apiserver)
    if kube_apiserver.kubectl("get", "serviceaccount", "-n", PLUGIN_NAMESPACE, PLUGIN_ACCOUNT,
                              check=False).returncode != 0:
        kube_apiserver.kubectl("create", "serviceaccount", "-n", PLUGIN_NAMESPACE,
                               PLUGIN_ACCOUNT)
    return Account(kube_apiserver, role["metadata"]["namespace"], config_map)


def put_config(server: ApiServer, account: Account, text: str) -> None:
    """Create or replace the ConfigMap's ``config.yaml`` (as the admin)."""
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": account.config_map, "namespace": account.namespace},
            "data": {"config.yaml": text}}
    server.kubectl("apply", "-f", "-", stdin=json.dumps(body))


def label(server: ApiServer, node: str, value: str | None) -> None:
    arg = f"{CONFIG_LABEL}-" if value is None else f"{CONFIG_LABEL}={value}"
    server.kubectl("label", "node", node, arg, "--overwrite")


def node_of(server: ApiServer, node: str) -> dict[str, Any]:
    status, body = server.request("GET", f"/api/v1/nodes/{node}")
    assert status == 200, body
    return dict(body)


def state_of(server: ApiServer, node: str) -> str | None:
    labels = node_of(server, node)["metadata"].get("labels") or {}
    value = labels.get(STATE_LABEL)
    return None if value is None else str(value)


def wait_state(server: ApiServer, node: str, want: str, plugin: Plugin,
               timeout: float = 60) -> None:
    def reached() -> bool:
        assert plugin.proc.poll() is None, plugin.log()
        return state_of(server, node) == want
    try:
        wait_for(reached, f"{STATE_LABEL} to become {want!r}", timeout, every_s=0.1)
    except AssertionError as err:
        raise AssertionError(f"{err} (is {state_of(server, node)!r}):\n"
                             f"{plugin.log()[-4000:]}") from None


def states_since(server: ApiServer, node: str, resource_version: str) -> list[str | None]:
    """Every value the state label took after ``resource_version``, in order, from a watch
    replaying the Node's events (consecutive repeats folded: kubelet-free, but still)."""
    host, port = server.url.removeprefix("https://").rsplit(":", 1)
    conn = http.client.HTTPSConnection(
        host, int(port), context=ssl.create_default_context(cafile=str(server.ca)), timeout=30)
    try:
        conn.request("GET", f"/api/v1/nodes?fieldSelector=metadata.name={node}&watch=true"
                            f"&resourceVersion={resource_version}&timeoutSeconds=1",
                     headers={"Authorization": f"Bearer {server.token}"})
        payload = conn.getresponse().read().decode()
    finally:
        conn.close()
    seen: list[str | None] = []
    for line in payload.splitlines():
        labels = json.loads(line)["object"]["metadata"].get("labels") or {}
        value = labels.get(STATE_LABEL)
        if not seen or seen[-1] != value:
            seen.append(value)
    return seen


def layout(agent: AgentProcess) -> list[dict[str, Any]]:
    """The agent's current layout as mig-parted entries (``GET /v1/mig/export``)."""
    reply = agent.request("GET", "/v1/mig/export")
    assert reply.status == 200, reply.body
    return list(reply.body["mig-configs"]["current"])


def everywhere(mig_devices: dict[str, int] | None) -> list[dict[str, Any]]:
    if mig_devices is None:
        return [{"devices": "all", "mig-enabled": False}]
    return [{"devices": "all", "mig-enabled": True, "mig-devices": mig_devices}]


@dataclass
class Plugin:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out

    def wait_line(self, match: Callable[[dict[str, Any]], bool], *, after: int = 0,
                  timeout: float = 60) -> dict[str, Any]:
        """The first JSON log line past the first ``after`` that ``match`` accepts."""
        def found() -> dict[str, Any] | None:
            line = next((line for line in self.lines()[after:] if match(line)), None)
            assert line is not None or self.proc.poll() is None, self.log()
            return line
        try:
            line: dict[str, Any] = wait_for(found, "the log line", timeout, every_s=0.1)
        except AssertionError as err:
            raise AssertionError(f"{err}:\n{self.log()[-4000:]}") from None
        return line


StartPlugin = Callable[..., tuple[AgentProcess, Plugin]]


def _private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def node_with_plugin(kube_apiserver: ApiServer, agent_node: StartAgent, account: Account,
                     tmp_path: Path) -> Iterator[StartPlugin]:
    """``start(node, mode=True)``: a simulated DGX H100 agent for ``node`` (tokens: admin,
    ``claims`` for the plugin, ``geometry,read`` for the label mode) and the real plugin
    process against it and the API server, ``--mig-config-map`` given when ``mode``."""
    started: list[Plugin] = []
    short = Path(tempfile.mkdtemp(prefix="ml", dir="/tmp"))  # socket paths stay short

    def start(node: str, *, mode: bool = True) -> tuple[AgentProcess, Plugin]:
        kube_apiserver.ensure_node(node)
        tokens = _private(tmp_path / "agent.tokens",
                          "admin:admin-secret\nkubelet-plugin:claims-secret:claims\n"
                          "kubelet-plugin-mig:mig-secret:geometry,read\n")
        agent = agent_node("dgx-h100", node_name=node, extra=("--token-file", str(tokens)))
        agent.token = "admin-secret"
        root = short / str(len(started))
        root.mkdir()
        claims = _private(root / "claims.token", "claims-secret\n")
        mig = _private(root / "mig.token", "mig-secret\n")
        log_path = tmp_path / f"plugin-{len(started)}.log"
        args = [sys.executable, "-m", "agent", "kubelet-plugin",
                "--agent-socket", str(agent.socket_path), "--token-file", str(claims),
                "--node-name", node,
                "--kubeconfig", str(account.kubeconfig(node, root / "kubeconfig")),
                "--registry-dir", str(root / "reg"), "--plugins-dir", str(root / "plug"),
                "--health-listen", "127.0.0.1:0", "--log-format", "json"]
        if mode:
            args += ["--mig-config-map", f"{account.namespace}/{account.config_map}",
                     "--mig-token-file", str(mig)]
        with log_path.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ), start_new_session=True)
        plugin = Plugin(proc, log_path)
        started.append(plugin)
        plugin.wait_line(lambda line: line.get("msg") == "kubelet plugin started")
        return agent, plugin

    yield start
    for plugin in started:
        if plugin.proc.poll() is None:
            plugin.proc.send_signal(signal.SIGTERM)
            try:
                plugin.proc.wait(20)
            except subprocess.TimeoutExpired:
                plugin.proc.kill()
                plugin.proc.wait()
    shutil.rmtree(short, ignore_errors=True)


def _applied(reason: str) -> Callable[[dict[str, Any]], bool]:
    return lambda line: line.get("msg") == "MIG config label" and line.get("state") == \
        "success" and line.get("reason", "").startswith(reason)


def test_label_applies_its_entry_pending_then_success(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """Setting nvidia.com/mig.config on the Node gives every GPU that entry of the ConfigMap's
    config.yaml, while the state label goes pending, then success; nothing else."""
    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    node = "miglabels-apply"
    agent, plugin = node_with_plugin(node)
    before = node_of(kube_apiserver, node)["metadata"]["resourceVersion"]
    assert layout(agent) != everywhere(BALANCED)

    label(kube_apiserver, node, "all-balanced")
    wait_state(kube_apiserver, node, "success", plugin)

    assert layout(agent) == everywhere(BALANCED)
    assert states_since(kube_apiserver, node, before) == [None, "pending", "success"]


def test_unknown_label_fails_with_the_agents_reason(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """A label the config lacks sets failed at once (never pending), logs the agent's reason
    naming the label and the labels it has, and changes no GPU."""
    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    node = "miglabels-unknown"
    agent, plugin = node_with_plugin(node)
    before = node_of(kube_apiserver, node)["metadata"]["resourceVersion"]
    was = layout(agent)

    label(kube_apiserver, node, "all-3g.40gb")
    wait_state(kube_apiserver, node, "failed", plugin)

    line = plugin.wait_line(lambda line: line.get("msg") == "MIG config label failed")
    assert line["mig_config"] == "all-3g.40gb"
    assert "unknown MIG config 'all-3g.40gb'" in line["reason"], line
    assert "all-balanced" in line["reason"] and "custom" in line["reason"], line
    assert layout(agent) == was
    assert states_since(kube_apiserver, node, before) == [None, "failed"]


def test_config_map_edit_reapplies_the_label(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """Editing the ConfigMap re-applies the Node's label as the config now defines it: an edit
    elsewhere in the file is a dry run that changes nothing (no pending), an edit of the
    label's entry changes every GPU (pending, then success)."""
    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    node = "miglabels-edit"
    agent, plugin = node_with_plugin(node)
    label(kube_apiserver, node, "custom")
    wait_state(kube_apiserver, node, "success", plugin)
    assert layout(agent) == everywhere({"1g.10gb": 7})

    seen = len(plugin.lines())
    before = node_of(kube_apiserver, node)["metadata"]["resourceVersion"]
    put_config(kube_apiserver, account, config_yaml(
        {"1g.10gb": 7}, extra=ALL_ENABLED))
    plugin.wait_line(_applied("already applied"), after=seen)
    assert "pending" not in states_since(kube_apiserver, node, before)
    assert layout(agent) == everywhere({"1g.10gb": 7})

    before = node_of(kube_apiserver, node)["metadata"]["resourceVersion"]
    seen = len(plugin.lines())
    put_config(kube_apiserver, account, config_yaml({"7g.80gb": 1}))
    plugin.wait_line(_applied("applied to 8 GPU(s)"), after=seen)
    assert layout(agent) == everywhere({"7g.80gb": 1})
    assert states_since(kube_apiserver, node, before) in (["pending", "success"],
                                                          ["success", "pending", "success"])


def test_removing_the_state_label_retries(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """Removing the state label runs the Node's label again (the retry after a failure,
    without touching the label): here a dry run finds it applied and writes success back."""
    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    node = "miglabels-retry"
    agent, plugin = node_with_plugin(node)
    label(kube_apiserver, node, "all-disabled")
    wait_state(kube_apiserver, node, "success", plugin)
    seen = len(plugin.lines())
    kube_apiserver.kubectl("label", "node", node, f"{STATE_LABEL}-")
    plugin.wait_line(_applied("already applied"), after=seen)
    assert state_of(kube_apiserver, node) == "success"
    assert layout(agent) == everywhere(None)


def test_missing_config_map_fails_until_it_comes(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """Without the ConfigMap the label fails, naming the ConfigMap; once it is created the
    label is applied with no other change."""
    kube_apiserver.kubectl("delete", "configmap", "-n", account.namespace, account.config_map,
                           "--ignore-not-found")
    node = "miglabels-no-config"
    agent, plugin = node_with_plugin(node)
    label(kube_apiserver, node, "all-balanced")
    wait_state(kube_apiserver, node, "failed", plugin)
    line = plugin.wait_line(lambda line: line.get("msg") == "MIG config label failed")
    assert line["reason"] == f"ConfigMap {account.namespace}/{account.config_map} not found"

    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    wait_state(kube_apiserver, node, "success", plugin)
    assert layout(agent) == everywhere(BALANCED)


def test_mode_off_ignores_the_label(
        kube_apiserver: ApiServer, account: Account,
        node_with_plugin: StartPlugin) -> None:
    """Without --mig-config-map the plugin neither applies nvidia.com/mig.config nor writes
    the state label (a running mig-manager owns both)."""
    put_config(kube_apiserver, account, config_yaml({"1g.10gb": 7}))
    node = "miglabels-off"
    agent, plugin = node_with_plugin(node, mode=False)
    was = layout(agent)
    assert was != everywhere(BALANCED)

    label(kube_apiserver, node, "all-balanced")
    time.sleep(3)  # the mode on answers within a second (the tests above)

    assert state_of(kube_apiserver, node) is None
    assert layout(agent) == was
    assert not any(line.get("msg", "").startswith(("MIG config label", "following the Node"))
                   for line in plugin.lines())


def test_policy_lets_the_plugin_write_only_its_own_state_label(
        kube_apiserver: ApiServer, account: Account, tmp_path: Path) -> None:
    """With the plugin's token for one node, the overlay's admission policy admits a change
    of that Node's nvidia.com/mig.config.state and refuses any other label, another Node's
    state label, and a change to the Node's spec."""
    mine, other = "miglabels-policy", "miglabels-policy-other"
    for node in (mine, other):
        kube_apiserver.ensure_node(node)
    plugin = account.kubeconfig(mine, tmp_path / "plugin.kubeconfig")

    def as_plugin(*args: str) -> subprocess.CompletedProcess[str]:
        return kube_apiserver.kubectl(*args, kubeconfig=plugin, check=False)

    allowed = as_plugin("label", "node", mine, f"{STATE_LABEL}=success", "--overwrite")
    assert allowed.returncode == 0, allowed.stderr

    def policy_in_force() -> bool:
        # The API server starts enforcing a policy just applied a moment later (its
        # informers); a label that got through before then is taken off again.
        probe = as_plugin("label", "node", mine, f"{CONFIG_LABEL}=all-disabled")
        if probe.returncode == 0:
            kube_apiserver.kubectl("label", "node", mine, f"{CONFIG_LABEL}-")
        return "denied request" in probe.stderr

    waiting.wait_for(policy_in_force, "the admission policy to be in force", 30)
    for args, why in [
            (("label", "node", mine, f"{CONFIG_LABEL}=all-disabled"), "only the Node label"),
            (("label", "node", mine, "team=x"), "only the Node label"),
            (("label", "node", mine, f"{STATE_LABEL}-"), None),
            (("label", "node", other, f"{STATE_LABEL}=success"), "only its own Node"),
            (("cordon", mine), "may not change a Node's spec"),
            (("annotate", "node", mine, "a=b"), "only the Node annotations")]:
        refused = as_plugin(*args)
        if why is None:  # removing the state label is the label mode's own business too
            assert refused.returncode == 0, (args, refused.stderr)
            continue
        # (kubectl cordon exits 0 on a refused patch: the message and the Node tell.)
        assert "denied request" in refused.stderr and why in refused.stderr, \
            (args, refused.stderr)
    assert state_of(kube_apiserver, other) is None
    node = node_of(kube_apiserver, mine)
    assert "team" not in (node["metadata"].get("labels") or {})
    assert CONFIG_LABEL not in (node["metadata"].get("labels") or {})
    assert not node.get("spec", {}).get("unschedulable")
    assert "a" not in (node["metadata"].get("annotations") or {})
