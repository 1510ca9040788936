"""The real stack for one test: a simulated agent process, the Node object, the shipped
ClusterRole bound to a ServiceAccount, a real ``gpu-agent kubelet-plugin`` process using that
account's token, and kubelet's DRA manager (the Go harness) registered against the plugin.

``stack(server, preset, node=...)`` (the ``stack`` fixture of tests/k8s/conftest.py) returns a
:class:`Stack`; everything it started stops at the end of the test. Nothing here is mocked:
the plugin talks to the agent over its Unix socket with a ``claims``-scope token, and to the
API server with only what daemonset/base/rbac.yaml grants, under admissionpolicy.yaml, with
a ServiceAccount token bound to a Pod on its node (as the DaemonSet's projected token is).
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.agent_process import AgentProcess, kill_daemons_of, start_agent
from tests.k8s.harness import ApiServer, KubeletHarness
from tests.k8s.objects import DRIVER

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "daemonset" / "base" / "rbac.yaml"
ADMISSION_POLICY = ROOT / "daemonset" / "base" / "admissionpolicy.yaml"
DEVICE_CLASSES = ROOT / "daemonset" / "base" / "deviceclasses.yaml"
# The shipped binding and admission policy name this account; the stack uses the same one
# so the manifests are applied as shipped (no edited copy to drift from them).
PLUGIN_NAMESPACE = "gpu-node-agent"
PLUGIN_ACCOUNT = "gpu-node-agent"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RESOURCE = "/apis/resource.k8s.io/v1"

Json = dict[str, Any]


def gpu_agent_command() -> list[str]:
    """``gpu-agent`` from the running venv's bin (as the container runs it); ``python -m
    agent`` where the venv has no entry point."""
    script = Path(sys.executable).parent / "gpu-agent"
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent"]


def apply_shipped(server: ApiServer, path: Path) -> None:
    """``kubectl apply`` a shipped manifest as it is (idempotent: session servers are shared)."""
    server.kubectl("apply", "-f", str(path))


def ensure_namespace(server: ApiServer, name: str) -> None:
    status, body = server.request("GET", f"/api/v1/namespaces/{name}")
    if status == 404:
        status, body = server.request("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        assert status in (201, 409), body


def plugin_kubeconfig(server: ApiServer, node: str, path: Path) -> Path:
    """A kubeconfig (mode 0600) for the plugin on ``node``, as the DaemonSet's pod gets it:
    the shipped ClusterRole, binding and ValidatingAdmissionPolicy applied as they are, and
    a token of the binding's ServiceAccount bound to a Pod of that account on ``node`` (so
    the API server names the node in the token's extra info, which the policy checks)."""
    ensure_namespace(server, PLUGIN_NAMESPACE)
    apply_shipped(server, RBAC)
    apply_shipped(server, ADMISSION_POLICY)
    if server.kubectl("get", "serviceaccount", "-n", PLUGIN_NAMESPACE, PLUGIN_ACCOUNT,
                      check=False).returncode != 0:
        server.kubectl("create", "serviceaccount", "-n", PLUGIN_NAMESPACE, PLUGIN_ACCOUNT)
    pod_name = f"kubelet-plugin-{node}"
    pods = f"/api/v1/namespaces/{PLUGIN_NAMESPACE}/pods"
    status, body = server.request("GET", f"{pods}/{pod_name}")
    if status == 404:
        status, body = server.request("POST", pods, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": PLUGIN_NAMESPACE},
            "spec": {"nodeName": node, "serviceAccountName": PLUGIN_ACCOUNT,
                     "containers": [{"name": "kubelet-plugin",
                                     "image": "registry.invalid/gpu-node-agent"}]}})
    assert status in (200, 201), body
    token = server.kubectl("create", "token", "-n", PLUGIN_NAMESPACE, PLUGIN_ACCOUNT,
                           "--bound-object-kind", "Pod", "--bound-object-name", pod_name,
                           "--bound-object-uid", body["metadata"]["uid"],
                           "--duration=1h").stdout.strip()
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "harness", "cluster": {"server": server.url,
                                                      "certificate-authority": str(server.ca)}}],
        "users": [{"name": PLUGIN_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "plugin", "context": {"cluster": "harness",
                                                    "user": PLUGIN_ACCOUNT}}],
        "current-context": "plugin"}))
    path.chmod(0o600)
    return path


def server_slices(server: ApiServer, node: str) -> list[Json]:
    """The ResourceSlices the API server holds for ``node``'s pool, by name."""
    status, body = server.request("GET", f"{SLICES}?fieldSelector=spec.nodeName={node}")
    assert status == 200, body
    return sorted(body["items"], key=lambda s: s["metadata"]["name"])


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 30,
             interval: float = 0.05, log: Callable[[], str] | None = None) -> Any:
    """Call ``probe`` until it answers something truthy; that answer, or AssertionError
    naming ``what`` (and the tail of ``log``) after ``timeout`` seconds."""
    try:
        return waiting.wait_for(probe, what, timeout, every_s=interval)
    except AssertionError as err:
        if log is None:
            raise
        raise AssertionError(f"{err}\n{log()[-4000:]}") from None


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? "
                     r"(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class PluginProcess:
    """One ``gpu-agent kubelet-plugin`` process; its health listener's bound address is read
    from its "health listener up" log line."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]
    health: tuple[str, int] = ("", 0)

    @classmethod
    def start(cls, args: list[str], log_path: Path, timeout: float = 30) -> PluginProcess:
        offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        plugin = cls(proc, log_path, args)

        def listening() -> bool:
            for line in log_path.read_bytes()[offset:].splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("msg") == "health listener up":
                    host, port = str(event["listen"]).rsplit(":", 1)
                    plugin.health = (host, int(port))
                    return True
            if proc.poll() is not None:
                raise AssertionError(f"plugin exited with {proc.returncode}:\n{plugin.log()}")
            return False
        try:
            waiting.wait_for(listening, "the plugin's health listener", timeout, every_s=0.05)
        except AssertionError:
            if proc.poll() is None:
                plugin.stop(signal.SIGKILL)
            raise AssertionError(f"plugin health listener not up:\n{plugin.log()}") from None
        return plugin

    def get(self, path: str) -> tuple[int, str]:
        """One GET on the health listener: (status, body text)."""
        url = f"http://{self.health[0]}:{self.health[1]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def readyz(self) -> tuple[int, Json]:
        status, text = self.get("/readyz")
        return status, json.loads(text)

    def wait_ready(self, timeout: float = 30) -> Json:
        """Wait until ``/readyz`` answers 200 (registered, agent, API server, slices in sync)."""
        last: list[Json] = [{}]

        def ready() -> bool:
            self.check_alive()
            try:
                status, last[0] = self.readyz()
            except OSError:
                return False
            return status == 200

        wait_for("plugin /readyz 200", ready, timeout,
                 log=lambda: f"last /readyz: {last[0]}\n{self.log()}")
        return last[0]

    def metrics(self) -> str:
        status, text = self.get("/metrics")
        assert status == 200, text
        return text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            match = _SAMPLE.match(line)
            if not match or match["name"] != name:
                continue
            have = dict(_LABEL.findall(match["labels"] or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(match["value"])
        return total

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"plugin exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@dataclass
class Stack:
    """Agent, plugin and kubelet harness for one node of one API server."""

    server: ApiServer
    node: str
    root: Path
    preset: str
    agent_extra: list[str]
    plugin_extra: list[str]
    kubelet_version: str
    kubelet_gates: str
    agent: AgentProcess = field(init=False)
    plugin: PluginProcess = field(init=False)
    kubelet: KubeletHarness | None = field(init=False, default=None)
    _kubelets: list[KubeletHarness] = field(init=False, default_factory=list)
    _plugins: list[PluginProcess] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.agent_dir = self.root / "agent"
        self.agent_dir.mkdir(parents=True, exist_ok=True)
        self.cdi_dir = self.root / "cdi"
        # KubeletHarness watches <root>/plugins_registry; one root for every kubelet start,
        # so a restarted kubelet keeps its DRA checkpoint as a real one does.
        self.kubelet_root = self.root / "kubelet"
        self.registry_dir = self.kubelet_root / "plugins_registry"
        self.plugins_dir = self.kubelet_root / "plugins"
        # The agent's tokens: one with every scope for the test's own calls (first, so
        # start_agent picks it), one with only ``claims`` for the plugin (its own file).
        plugin_token = secrets.token_hex(16)
        tokens = self.agent_dir / "tokens"
        tokens.write_text(f"test:{secrets.token_hex(16)}:admin\n"
                          f"kubelet-plugin:{plugin_token}:claims\n")
        tokens.chmod(0o600)
        self.plugin_token_file = self.root / "plugin-token"
        self.plugin_token_file.write_text(plugin_token + "\n")
        self.plugin_token_file.chmod(0o600)
        self.server.ensure_node(self.node)
        self.kubeconfig = plugin_kubeconfig(self.server, self.node,
                                            self.root / "plugin.kubeconfig")

    # --- the agent -------------------------------------------------------------------------

    def start_agent(self) -> AgentProcess:
        """Start (or start again, same state dir) the agent: the socket, tokens, CDI dir."""
        self.agent = start_agent(self.agent_dir, preset=self.preset, extra=[
            "--node-name", self.node, "--token-file", str(self.agent_dir / "tokens"),
            "--auth-read", "--cdi-dir", str(self.cdi_dir), *self.agent_extra])
        return self.agent

    def kill_agent(self, sig: int = signal.SIGKILL) -> int:
        """Stop the agent (SIGKILL by default: a crash); its exit status."""
        return self.agent.stop(sig)

    def restart_agent(self, sig: int = signal.SIGTERM) -> AgentProcess:
        self.kill_agent(sig)
        return self.start_agent()

    def agent_claims(self) -> list[Json]:
        """The claims the agent holds (``GET /v1/claims``)."""
        reply = self.agent.request("GET", "/v1/claims")
        assert reply.status == 200, reply.body
        body = reply.body
        return list(body["claims"])

    # --- the plugin ------------------------------------------------------------------------

    def plugin_args(self) -> list[str]:
        return [*gpu_agent_command(), "kubelet-plugin",
                "--agent-socket", str(self.agent.socket_path),
                "--token-file", str(self.plugin_token_file), "--node-name", self.node,
                "--kubeconfig", str(self.kubeconfig),
                "--registry-dir", str(self.registry_dir), "--plugins-dir", str(self.plugins_dir),
                "--health-listen", "127.0.0.1:0", "--log-format", "json", *self.plugin_extra]

    def start_plugin(self) -> PluginProcess:
        self.plugin = PluginProcess.start(self.plugin_args(), self.root / "plugin.log")
        self._plugins.append(self.plugin)
        return self.plugin

    def restart_plugin(self, sig: int = signal.SIGTERM) -> PluginProcess:
        """Stop the plugin (SIGTERM: it deregisters; SIGKILL: a crash) and start it again."""
        self.plugin.stop(sig)
        return self.start_plugin()

    # --- kubelet ---------------------------------------------------------------------------

    def start_kubelet(self, *, wait_registered: bool = True) -> KubeletHarness:
        """Kubelet's DRA manager on this node watching the plugin's registry dir (it wipes
        the node's slices at start, as kubelet does), registered with the plugin. A second
        call stops the first harness: a kubelet restart."""
        if self.kubelet is not None:
            self.kubelet.close()
        harness = KubeletHarness(self.kubelet_version, self.server, node=self.node,
                                 root=self.kubelet_root, feature_gates=self.kubelet_gates)
        self._kubelets.append(harness)
        self.kubelet = harness
        if wait_registered:
            self.plugin.check_alive()
            answer = harness.wait_registered(DRIVER)
            assert answer["ok"], f"{answer}\n{harness.log()}\n{self.plugin.log()}"
        return harness

    # --- the API server's view -------------------------------------------------------------

    def resource_slices(self) -> list[Json]:
        """This node's ResourceSlices as the API server holds them."""
        return server_slices(self.server, self.node)

    def wait_slices(self, until: Callable[[list[Json]], bool] | None = None,
                    timeout: float = 30) -> list[Json]:
        """This node's slices once ``until(slices)`` holds (default: any slice published)."""
        check = until or bool

        def probe() -> list[Json] | None:
            found = self.resource_slices()
            return found if found and check(found) else None

        result: list[Json] = wait_for(f"slices of {self.node}", probe, timeout,
                                      log=self.plugin.log)
        return result

    def wait_current(self, timeout: float = 30) -> list[Json]:
        """This node's slices once the API server holds exactly what the agent renders now:
        one generation, every slice of the pool, the same devices and counter sets. What a
        scheduler sees a moment after a change (a claim's prepare switches MIG on or makes
        an instance) before the publisher has caught up is a pool of mixed generations, or
        the complete pool of the generation before the change: the same device names (a
        dynamic MIG pool lists every device whatever is made) with the old content. The
        agent bumps its generation on every content change and the publisher writes at
        least that one, so a pool below the agent's generation is not current; but a
        publisher's generation may run ahead of the agent's (each write is above the last,
        ``resource_slice_plan``), so what tells a made MIG device from the placement it was
        is compared too: each device's attributes and counter sets. (Not the marks the
        publisher strips where the server drops them: shares, taints; nor capacities and
        counter values, which the server writes back in canonical form, "40960Mi" as
        "40Gi".)"""
        version = self.server.version

        def names(items: list[Json], key: str) -> set[str]:
            return {entry["name"] for item in items for entry in item["spec"].get(key, [])}

        def matched_on(items: list[Json]) -> dict[str, Any]:
            return {device["name"]: (
                {k: v for k, v in device.get("attributes", {}).items() if k != "shareable"},
                sorted(c["counterSet"] for c in device.get("consumesCounters", [])))
                for item in items for device in item["spec"].get("devices", [])}

        def current(found: list[Json]) -> bool:
            # The node's pool only: its compute-domain slot (spec.nodeSelector) is a pool
            # of its own, published apart (agent/kubeplugin/domain_slots.py).
            rendered = [item for item in self.agent.request(
                "GET", f"/v1/resourceslices?kubernetes={version}").body["items"]
                if "nodeName" in item["spec"]]
            pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
                     for s in found}
            generation = max((s["spec"]["pool"]["generation"] for s in rendered), default=0)
            return (len(pools) == 1 and next(iter(pools))[1] == len(found)
                    and next(iter(pools))[0] >= generation
                    and names(found, "devices") == names(rendered, "devices")
                    and names(found, "sharedCounters") == names(rendered, "sharedCounters")
                    and matched_on(found) == matched_on(rendered))

        return self.wait_slices(current, timeout)

    def close(self) -> None:
        for harness in self._kubelets:
            harness.close()
        for plugin in self._plugins:
            plugin.stop()
        if getattr(self, "agent", None) is not None:
            self.agent.stop(signal.SIGKILL)
        kill_daemons_of(self.agent_dir)  # what the agent leaves running by design (IMEX)


StartStack = Callable[..., Stack]


def stack_factory() -> Iterator[StartStack]:
    """The body of the ``stack`` fixture: ``start(server, preset, node=..., dynamic_mig=False,
    agent_extra=(), plugin_extra=(), kubelet=True, kubelet_version=server.version,
    kubelet_gates="")`` starts agent, plugin and (unless ``kubelet=False``) the kubelet
    harness, and waits until the plugin is registered and its slices are in the server."""
    started: list[Stack] = []
    roots: list[Path] = []

    def start(server: ApiServer, preset: str, *, node: str, dynamic_mig: bool = False,
              agent_extra: Sequence[str] = (), plugin_extra: Sequence[str] = (),
              kubelet: bool = True, kubelet_version: str | None = None,
              kubelet_gates: str = "") -> Stack:
        # Socket paths (kubelet's plugins dir holds <driver>/dra.sock) must fit 107 bytes,
        # which pytest's tmp_path does not leave room for.
        root = Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp"))
        roots.append(root)
        stack = Stack(server, node, root, preset,
                      [*(["--dynamic-mig"] if dynamic_mig else []), *agent_extra],
                      list(plugin_extra), kubelet_version or server.version, kubelet_gates)
        started.append(stack)
        stack.start_agent()
        stack.start_plugin()
        if kubelet:
            stack.start_kubelet()
            stack.plugin.wait_ready()
        return stack

    yield start
    for stack in started:
        stack.close()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stack() -> Iterator[StartStack]:
    """Real agent + ``gpu-agent kubelet-plugin`` + kubelet harness per test (see
    :func:`stack_factory`), stopped at the end of the test."""
    yield from stack_factory()
