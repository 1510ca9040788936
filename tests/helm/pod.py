"""A DaemonSet's pod brought up the way kubelet would, without containers: the Pod object made
from the pod template as the API server stored it (what the DaemonSet controller does), its
volumes materialised under a directory (host paths kept across pods, Secrets with their items
and modes, a bound ServiceAccount token for the projected one, emptyDirs), and each container
started as a process with the template's command, args and env, every path in them seen
through the container's mounts (``<root>/c/<container><mountPath>`` links to the volume).

What cannot be the template's, and only that, is changed, in :meth:`NodePod.start`'s
``extra``: the agent runs the simulator (``--simulate``), the plugin gets a ``--kubeconfig``
holding the projected token and CA (the in-cluster configuration reads a fixed path), and
listeners on the pod IP or all addresses bind 127.0.0.1 on a free port."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess
from tests.k8s.harness import ApiServer
from tests.k8s.stack import PluginProcess, gpu_agent_command
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
Json = dict[str, Any]
#: The image's entrypoint, for a container that names no command (the agent's).
ENTRYPOINT: list[str] = json.loads(re.findall(r"^ENTRYPOINT (\[.*\])$",
                                              (ROOT / "Containerfile").read_text(), re.M)[-1])
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_ADDRESS = re.compile(r"^(?:\d{1,3}(?:\.\d{1,3}){3}|\$\(POD_IP\)):\d+$")


@dataclass
class PodAgent(AgentProcess):
    """The agent container's process: its Unix socket is where the template's
    ``--listen=unix:`` put it, not in the state directory."""

    socket: Path = Path()

    @property
    def socket_path(self) -> Path:
        return self.socket


@dataclass
class NodePod:
    """One pod of DaemonSet ``daemonset`` on ``node``: ``root`` holds the node's host paths
    (``root/host``, shared by every pod on the node) and this pod's volumes."""

    server: ApiServer
    namespace: str
    daemonset: str
    node: str
    root: Path
    template: Json = field(init=False)
    pod: Json = field(init=False)
    volumes: dict[str, Path] = field(init=False, default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        status, ds = self.server.request(
            "GET", f"/apis/apps/v1/namespaces/{self.namespace}/daemonsets/{self.daemonset}")
        assert status == 200, ds
        self.template = ds["spec"]["template"]
        # Unique as the DaemonSet controller's generated names are (a deleted pod's name may
        # still be taken while the server waits for it to go).
        name = f"{self.daemonset}-{ds['metadata']['uid'][:5]}-{ds['metadata']['generation']}"
        status, self.pod = self.server.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": self.template["metadata"]["labels"],
                             "ownerReferences": [{
                                 "apiVersion": "apps/v1", "kind": "DaemonSet",
                                 "name": self.daemonset, "uid": ds["metadata"]["uid"],
                                 "controller": True}]},
                "spec": {**self.template["spec"], "nodeName": self.node}})
        assert status == 201, self.pod
        for volume in self.template["spec"]["volumes"]:
            self.volumes[volume["name"]] = self._materialise(volume)

    @property
    def host(self) -> Path:
        """The node's filesystem: host-path volumes live under it and outlive the pod."""
        return self.root / "host"

    def host_path(self, path: str) -> Path:
        return self.host / path.lstrip("/")

    def _materialise(self, volume: Json) -> Path:
        name = volume["name"]
        if "hostPath" in volume:
            path = self.host_path(volume["hostPath"]["path"])
            path.mkdir(parents=True, exist_ok=True)
            return path
        path = self.root / "pods" / self.pod["metadata"]["uid"] / name
        path.mkdir(parents=True)
        if "emptyDir" in volume:
            return path
        if "secret" in volume:
            secret = volume["secret"]
            status, body = self.server.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/secrets/{secret['secretName']}")
            assert status == 200, f"volume {name}: Secret {secret['secretName']}: {body}"
            items = secret.get("items") or [{"key": k, "path": k} for k in body["data"]]
            for item in items:
                assert item["key"] in body["data"], f"volume {name}: no key {item['key']}"
                self._write(path / item["path"], base64.b64decode(body["data"][item["key"]]),
                            item.get("mode", secret.get("defaultMode", 0o644)))
            return path
        if "projected" in volume:
            mode = volume["projected"].get("defaultMode", 0o644)
            for source in volume["projected"]["sources"]:
                if "serviceAccountToken" in source:
                    self._write(path / source["serviceAccountToken"]["path"],
                                self.bound_token(source["serviceAccountToken"]).encode(), mode)
                elif "configMap" in source:
                    # kube-root-ca.crt (no controller-manager publishes it here): the CA.
                    assert source["configMap"]["name"] == "kube-root-ca.crt", source
                    for item in source["configMap"]["items"]:
                        self._write(path / item["path"], self.server.ca.read_bytes(), mode)
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"]["items"]:
                        assert item["fieldRef"]["fieldPath"] == "metadata.namespace", item
                        self._write(path / item["path"], self.namespace.encode(), mode)
            return path
        raise AssertionError(f"volume {name}: a kind this bed does not make: {volume}")

    @staticmethod
    def _write(path: Path, data: bytes, mode: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)

    def bound_token(self, source: Json) -> str:
        """The projected token kubelet asks for: of the pod's ServiceAccount, bound to the
        pod (the API server then names the pod's node in it)."""
        return self.server.kubectl(
            "create", "token", "-n", self.namespace, self.template["spec"]["serviceAccountName"],
            "--bound-object-kind", "Pod", "--bound-object-name", self.pod["metadata"]["name"],
            "--bound-object-uid", self.pod["metadata"]["uid"],
            f"--duration={source.get('expirationSeconds', 3600)}s").stdout.strip()

    def container(self, name: str) -> Json:
        (found,) = [c for c in self.template["spec"]["containers"] if c["name"] == name]
        return dict(found)

    def view(self, name: str) -> Path:
        """The container's filesystem: each mount path a link to its volume."""
        view = self.root / "c" / name
        for mount in self.container(name).get("volumeMounts", []):
            link = view / mount["mountPath"].lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(self.volumes[mount["name"]], target_is_directory=True)
        return view

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        """The container's command line and environment as kubelet would run them: $(VAR)
        expanded from its env, paths through its mounts, listeners on 127.0.0.1:0."""
        spec = self.container(name)
        view = self.view(name)
        env = {"POD_IP": "127.0.0.1"}
        for entry in spec.get("env", []):
            if "value" in entry:
                env[entry["name"]] = ":".join(self._path(view, p)
                                              for p in entry["value"].split(":"))
            else:
                path = entry["valueFrom"]["fieldRef"]["fieldPath"]
                env[entry["name"]] = {"spec.nodeName": self.node,
                                      "metadata.namespace": self.namespace,
                                      "status.podIP": "127.0.0.1",
                                      "status.hostIP": "127.0.0.1"}[path]
        args = [self._arg(view, env, a) for a in spec.get("args", [])]
        command = spec.get("command") or ENTRYPOINT
        assert command[0] == "gpu-agent", command
        return [*gpu_agent_command(), *command[1:], *args], env

    def _arg(self, view: Path, env: dict[str, str], arg: str) -> str:
        flag, equals, value = arg.partition("=")
        if not equals:
            return arg
        value = _VARIABLE.sub(lambda m: env.get(m[1], m[0]), value)
        if _ADDRESS.match(value):
            value = "127.0.0.1:0"
        elif value.startswith("unix:/"):
            value = "unix:" + self._path(view, value.removeprefix("unix:"))
        else:
            value = self._path(view, value)
        return f"{flag}={value}"

    @staticmethod
    def _path(view: Path, value: str) -> str:
        return str(view / value.lstrip("/")) if value.startswith("/") else value

    def spawn(self, name: str, extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
        args, env = self.command(name)
        return [*args, *extra], {**os.environ, **env}

    def start_agent(self, *, preset: str, admin_token: str) -> PodAgent:
        """The agent container, on the simulator; ready (``/readyz`` on its socket)."""
        args, env = self.spawn("agent", ["--simulate", preset])
        view = self.view("agent")
        state = Path(_flag(args, "--state-dir"))
        socket = Path(_flag(args, "--listen", prefix="unix:").removeprefix("unix:"))
        (state / "listeners.json").unlink(missing_ok=True)
        log_path = self.root / f"agent-{self.pod['metadata']['uid']}.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(proc)
        agent = PodAgent(proc, state, log_path, token=admin_token, args=args, socket=socket)

        def ready() -> bool:
            agent._check_alive()
            try:
                return agent.request("GET", "/readyz", token=None, unix=True).status == 200
            except OSError:
                return False
        try:
            wait_for(ready, "the agent's /readyz on its socket", 60, every_s=0.1)
        except AssertionError:
            raise AssertionError(f"agent not ready:\n{agent.log()[-4000:]}") from None
        assert view.is_dir()
        return agent

    def start_plugin(self) -> PluginProcess:
        """The kubelet-plugin container, with a kubeconfig of its projected token and CA."""
        access = self.volumes["kube-api-access"]
        kubeconfig = self.root / f"plugin-{self.pod['metadata']['uid']}.kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "c", "cluster": {"server": self.server.url,
                                                    "certificate-authority":
                                                        str(access / "ca.crt")}}],
            "users": [{"name": "pod", "user": {"token": (access / "token").read_text()}}],
            "contexts": [{"name": "pod", "context": {"cluster": "c", "user": "pod"}}]}))
        kubeconfig.chmod(0o600)
        # Its env (NODE_NAME) is in its args already, expanded as kubelet expands $(VAR).
        args, _ = self.spawn("kubelet-plugin", ["--kubeconfig", str(kubeconfig)])
        plugin = PluginProcess.start(args, self.root / f"plugin-{self.pod['metadata']['uid']}.log")
        self.processes.append(plugin.proc)
        return plugin

    def stop(self) -> None:
        """The pod's end: SIGTERM to every container (as kubelet does), then its Pod object
        deleted; host paths stay."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        # Grace period 0: what kubelet's confirmation of the containers' end amounts to.
        self.server.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/"
                                      f"{self.pod['metadata']['name']}?gracePeriodSeconds=0")


def _flag(args: Sequence[str], flag: str, prefix: str = "") -> str:
    """The value of the first ``flag=value`` in ``args`` whose value starts with ``prefix``."""
    for arg in args:
        name, _, value = arg.partition("=")
        if name == flag and value.startswith(prefix):
            return value
    raise AssertionError(f"no {flag}={prefix}... in {list(args)}")
