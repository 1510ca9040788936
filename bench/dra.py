"""DRA: the kubelet plugin's prepare path, concurrency across GPUs, ResourceSlice republish
time, and the scheduler's allocator, against real Kubernetes components (tests/k8s).

Everything runs against a real ``gpu-agent serve --simulate dgx-h100`` process (NVML
latencies off unless said) and a real etcd + kube-apiserver (``k8s-harness apiserver`` of the
newest supported Kubernetes). The plugin runs as its real process
(``python -m bench.dra_plugin kubelet-plugin``, the ``gpu-agent kubelet-plugin`` command line)
twice: one reads each ResourceClaim from the API server with its own client (the production
path), one answers claims from memory (no GET), so the two differ only in that read.

1. **Prepare of an existing device** (a whole H100; a 1g.10gb of GPU 1, split 7x 1g):
   ``PUT /v1/claims/{uid}`` over the agent's socket (the plugin's own client and body: what
   the plugin sends), ``NodePrepareResources`` over the plugin's socket from a grpc.aio client
   with the committed stubs (the plugin hop alone), and ``prepare`` through kubelet's own DRA
   manager and gRPC client (``k8s-harness kubelet``; its ``elapsed_us`` includes what kubelet
   itself does around the call: it GETs the pod and the ResourceClaim from the API server and
   writes its checkpoint). Every sample is followed by its unprepare (kubelet's
   ``UnprepareResources`` for the kubelet rows), so kubelet's claim cache never answers a
   prepare itself: each measured prepare reaches the plugin, which is checked against the
   plugin's own ``gpu_agent_plugin_prepare_seconds_count``. Paths rotate sample by sample.
2. **56 prepares at once** on dgx-h100 split 7x 1g.10gb on every GPU (one claim per MIG
   device, each its own ``NodePrepareResources`` call, all in flight together) against the
   same claims prepared one at a time. Then the 49 claims of GPUs 0-6 at once, with GPU 7
   idle and while GPU 7 is being re-partitioned with its NVML MIG mutations slowed through the
   simulator's latency API (only GPU 7 calls those functions then): its seconds of work must
   not show in the other GPUs' prepares.
3. **Republish**: the production plugin wiring (claim reader and ResourceSlice publisher)
   against the API server; a watch on the node's ResourceSlices timestamps each event. From a
   MIG geometry change (``PUT /v1/gpus/{i}/mig``; also from the transition's own end) and
   from an XID (``POST /v1/sim/xid``, the GPU's devices get a blocking taint; then the reset
   that clears it) to the first watch event carrying the changed slice.
4. **Allocator**: ``k8s-harness allocate`` (the scheduler's structured allocator, one process
   per call) for one claim against the agent's dgx-h100 slices: a whole GPU, a static 1g.10gb
   (every GPU 7x 1g), a dynamic-MIG 1g.10gb (``--dynamic-mig``: every profile and placement);
   its own ``elapsed_us``, median of the runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.claims import KubeletClaim, agent_body, our_devices
from agent.kubeplugin.dra import arrival_ns
from agent.kubeplugin.proto import dra_v1_pb2, dra_v1_pb2_grpc
from bench.claims import machine, percentile
from tests.agent_process import AgentProcess, cpu_seconds, start_agent
from tests.k8s.harness import NEWEST, ApiServer, KubeletHarness, allocate, allocate_in_cluster
from tests.k8s.objects import DRIVER, MIG_CLASS, attr, claim, classes, pod, request
from tests.k8s.published import set_mig, slices_of

NODE = "bench-node"
PRESET = "dgx-h100"
GPUS = 8
ONE_G = "1g.10gb"
SEVEN = [ONE_G] * 7
SLICE_RULES = "1.35"  # what the 1.37 server is fed (tests/k8s/harness.SLICE_RULES)
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS_PATH = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
NVML_LOCK_TIMEOUT_S = 10.0  # NVIDIA's plugin: the node-wide prepare lock

SAMPLES = 200  # per prepare path and device kind
SINGLE_ROUNDS = 3  # the 56 MIG claims one at a time, this many times
BATCHES = 8  # of 56 at once
ISOLATION_BATCHES = 4  # of 49 at once, GPU 7 idle and GPU 7 busy
SLOW_NVML = {"nvmlGpuInstanceDestroy": 0.3, "nvmlDeviceCreateGpuInstanceWithPlacement": 0.3,
             "nvmlGpuInstanceCreateComputeInstance": 0.1, "nvmlComputeInstanceDestroy": 0.1}
REPUBLISH_REPEATS = 5
#: XID 48 (double-bit ECC: unhealthy, still answering) and 79 (fallen off the bus: lost).
XIDS = (48, 79)
ALLOCATOR_RUNS = 15
REPUBLISH_GOAL_S = 2.0
HOP_GOAL_S = 0.001


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Latencies of one row, in seconds."""

    n: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        return cls(len(values), percentile(values, 50), percentile(values, 99), max(values))


@dataclass
class PrepareResult:
    """Part 1: per (kind, path) the prepare latencies; per plugin (sent, reached)."""

    rows: dict[tuple[str, str], Stats] = field(default_factory=dict)
    reached: dict[str, tuple[int, int]] = field(default_factory=dict)

    def hop(self, kind: str) -> float:
        """p50 of the plugin's gRPC prepare (no GET) minus p50 of the REST prepare."""
        return self.rows[(kind, "grpc-memory")].p50 - self.rows[(kind, "rest")].p50


@dataclass
class ConcurrencyResult:
    """Part 2."""

    single: Stats
    concurrent: Stats
    idle: Stats
    busy: Stats
    busy_batches: int
    gpu7_busy_s: float
    slow_nvml: dict[str, float]
    #: CPU seconds per prepare+unprepare cycle in the batches of 56: agent, plugin, client.
    cpu_per_cycle: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def cpu_floor_s(self) -> float:
        """The least wall time 56 cycles' CPU needs on this machine's cores."""
        return len_claims() * sum(self.cpu_per_cycle) / (os.cpu_count() or 1)

    @property
    def ratio(self) -> float:
        return self.concurrent.p99 / self.single.p99


@dataclass
class RepublishResult:
    """Part 3: seconds per change (from the request; geometry also from the transition's
    end)."""

    geometry: list[float] = field(default_factory=list)
    geometry_after_end: list[float] = field(default_factory=list)
    #: per XID: to the unhealthy slice, and from the reset to the healthy one
    xid: dict[int, list[float]] = field(default_factory=dict)
    reset: dict[int, list[float]] = field(default_factory=dict)


@dataclass
class DraResult:
    prepare: PrepareResult | None = None
    concurrency: ConcurrencyResult | None = None
    republish: RepublishResult | None = None
    allocator: dict[str, Stats] = field(default_factory=dict)
    version: str = NEWEST


# --- processes -------------------------------------------------------------------------------


def _write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@dataclass
class Agent:
    """The agent process and the claims-scoped token file the plugin uses."""

    process: AgentProcess
    token_file: Path


def start_node_agent(state: Path, *, extra: Sequence[str] = ()) -> Agent:
    """A simulated dgx-h100 agent with an admin token (the bench's) and a ``claims``-scoped
    one for the plugin, as the DaemonSet gives it."""
    state.mkdir(parents=True, exist_ok=True)
    admin, plugin = secrets.token_hex(16), secrets.token_hex(16)
    _write_private(state / "tokens", f"admin:{admin}\nplugin:{plugin}:claims\n")
    process = start_agent(state, preset=PRESET, extra=[
        "--node-name", NODE, "--token-file", str(state / "tokens"), *extra])
    process.token = admin
    return Agent(process, _write_private(state.parent / "plugin.token", plugin + "\n"))


class PluginProcess:
    """``python -m bench.dra_plugin kubelet-plugin`` with the reader ``reader``
    (see bench/dra_plugin.py)."""

    def __init__(self, root: Path, agent: Agent, *, reader: str, registry_dir: Path,
                 kubeconfig: Path | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.plugins_dir = root / "plugins"
        self.dra_socket = self.plugins_dir / DRIVER / "dra.sock"
        self.log_path = root / "plugin.log"
        args = [sys.executable, "-m", "bench.dra_plugin", "kubelet-plugin",
                "--agent-socket", str(agent.process.socket_path),
                "--token-file", str(agent.token_file), "--node-name", NODE,
                "--driver", DRIVER, "--registry-dir", str(registry_dir),
                "--plugins-dir", str(self.plugins_dir), "--health-listen", "127.0.0.1:0",
                "--log-format", "json", *(["--kubeconfig", str(kubeconfig)] if kubeconfig
                                          else [])]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "BENCH_DRA_READER": reader},
                                         start_new_session=True)
        self.health = self._wait_started(30)

    def _wait_started(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry.get("msg") == "kubelet plugin started":
                        return f"http://{entry['health']}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"plugin did not start:\n{self.log()}")

    def prepares_seen(self) -> int:
        """``gpu_agent_plugin_prepare_seconds_count``: claims the plugin prepared."""
        with urllib.request.urlopen(f"{self.health}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith("gpu_agent_plugin_prepare_seconds_count"):
                return int(float(line.split()[-1]))
        return 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def _short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket path holds at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="bdra-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Stack:
    """Processes started by one run, stopped in reverse order."""

    def __init__(self) -> None:
        self._stops: list[Callable[[], Any]] = []

    def add(self, stop: Callable[[], Any]) -> None:
        self._stops.append(stop)

    def close(self) -> None:
        for stop in reversed(self._stops):
            with contextlib.suppress(Exception):
                stop()
        self._stops.clear()


# --- API server objects ----------------------------------------------------------------------


def _post_slices(server: ApiServer, agent: AgentProcess) -> None:
    status, body = server.request(
        "GET", f"{SLICES_PATH}?fieldSelector=spec.nodeName={NODE}")
    for item in (body or {}).get("items", []) if status == 200 else []:
        server.request("DELETE", f"{SLICES_PATH}/{item['metadata']['name']}")
    for item in slices_of(agent, SLICE_RULES):
        status, answer = server.request("POST", SLICES_PATH, item)
        assert status == 201, answer


def _apply_classes(server: ApiServer) -> None:
    for device_class in classes():
        server.kubectl("apply", "-f", "-", stdin=json.dumps(device_class))


def _claim_in_cluster(server: ApiServer, name: str, wanted: dict[str, Any],
                      count: int = 1) -> list[dict[str, Any]]:
    """``count`` claims ``name-<i>`` (one request ``wanted`` each) and one pod ``name`` using
    them all, allocated by the scheduler's allocator (status and reservedFor written); the
    claims as the server holds them."""
    names = [f"{name}-{i}" for i in range(count)]
    objects = []
    for claim_name in names:
        made = claim(claim_name, wanted)
        made["metadata"].pop("uid")
        objects.append(made)
    objects.append(pod(name, {f"c{i}": n for i, n in enumerate(names)}, node_name=NODE))
    server.apply(objects)
    answer = allocate_in_cluster(server, node=NODE, claims=[f"default/{n}" for n in names],
                                 pod=f"default/{name}")
    assert answer.allocated, answer.reason
    out = []
    for claim_name in names:
        status, stored = server.request("GET", f"{CLAIMS_PATH}/{claim_name}")
        assert status == 200, stored
        out.append(stored)
    return out


def _kubelet_claim(obj: dict[str, Any]) -> KubeletClaim:
    meta = obj["metadata"]
    return KubeletClaim(meta["namespace"], meta["uid"], meta["name"])


def _grpc_claim(obj: dict[str, Any]) -> dra_v1_pb2.Claim:
    meta = obj["metadata"]
    return dra_v1_pb2.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def _fake_claim(name: str, device: str) -> dict[str, Any]:
    """A ResourceClaim as the API server would answer it once allocated (for the in-memory
    reader only: the bench's 56 MIG claims)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                         "resourceVersion": "1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": MIG_CLASS, "allocationMode": "ExactCount", "count": 1}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}},
                "reservedFor": [{"resource": "pods", "name": name, "uid": f"pod-{name}"}]}}


# --- part 1: one prepare ---------------------------------------------------------------------


class _Grpc:
    """kubelet's side of the DRA v1 service on a plugin's socket (grpc.aio)."""

    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        self.stub = dra_v1_pb2_grpc.DRAPluginStub(self.channel)

    async def prepare(self, *claims: dra_v1_pb2.Claim) -> float:
        """One NodePrepareResources call; its seconds. Any claim's error raises."""
        started = time.perf_counter()
        answer = await self.stub.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(claims=list(claims)), timeout=60)
        elapsed = time.perf_counter() - started
        errors = {uid: r.error for uid, r in answer.claims.items() if r.error}
        if errors or len(answer.claims) != len(claims):
            raise AssertionError(f"prepare failed: {errors or dict(answer.claims)}")
        return elapsed

    async def unprepare(self, *claims: dra_v1_pb2.Claim) -> None:
        answer = await self.stub.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=list(claims)), timeout=60)
        errors = {uid: r.error for uid, r in answer.claims.items() if r.error}
        if errors:
            raise AssertionError(f"unprepare failed: {errors}")

    async def close(self) -> None:
        await self.channel.close()


def _kubelet_cycle(kubelet: KubeletHarness, pod_ref: str) -> float:
    prepared = kubelet.prepare(pod_ref)
    if not prepared["ok"]:
        raise AssertionError(f"kubelet prepare {pod_ref}: {prepared.get('error')}")
    unprepared = kubelet.unprepare(pod_ref)
    if not unprepared["ok"]:
        raise AssertionError(f"kubelet unprepare {pod_ref}: {unprepared.get('error')}")
    return float(prepared["elapsed_us"]) / 1e6


PATHS = ("rest", "grpc-memory", "grpc-apiserver", "kubelet-memory", "kubelet-apiserver")
KINDS = ("gpu", "mig")


def run_prepare(loop: asyncio.AbstractEventLoop, server: ApiServer, agent: Agent, root: Path,
                stack: _Stack, *, samples: int) -> PrepareResult:
    """Part 1 (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    set_mig(agent.process, 1, SEVEN)
    _post_slices(server, agent.process)
    _apply_classes(server)
    whole = request()
    mig = request(device_class_name=MIG_CLASS, selectors=(f'{attr("profile")} == "{ONE_G}"',))
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for kind, wanted in (("gpu", whole), ("mig", mig)):
        for path in PATHS:
            objects[(kind, path)] = _claim_in_cluster(server, f"p1-{kind}-{path}", wanted)[0]
    memory_file = root / "claims.json"
    memory_file.write_text(json.dumps(list(objects.values())))

    # Each plugin with its own kubelet (the registry directory is kubelet's).
    kubelets, plugins = {}, {}
    for reader, spec in (("memory", f"file:{memory_file}"), ("apiserver", "kube")):
        kubelet = KubeletHarness(NEWEST, server, node=NODE, root=root / f"kubelet-{reader}")
        stack.add(kubelet.close)
        plugin = PluginProcess(root / f"plugin-{reader}", agent, reader=spec,
                               registry_dir=kubelet.registry_dir, kubeconfig=server.kubeconfig)
        stack.add(plugin.stop)
        answer = kubelet.wait_registered(DRIVER)
        assert answer["ok"], answer
        kubelets[reader], plugins[reader] = kubelet, plugin
    before = {reader: plugin.prepares_seen() for reader, plugin in plugins.items()}
    client = AgentClient(agent.process.socket_path, agent.token_file)
    grpcs = {reader: _Grpc(plugin.dra_socket) for reader, plugin in plugins.items()}

    async def rest_cycle(obj: dict[str, Any]) -> float:
        kc = _kubelet_claim(obj)
        devices = our_devices(kc, obj, driver=DRIVER, pool=NODE)
        started = time.perf_counter()
        await client.prepare(kc.uid, agent_body(kc, obj, devices, arrival_ns()))
        elapsed = time.perf_counter() - started
        await client.unprepare(kc.uid, arrival_ns())
        return elapsed

    async def grpc_cycle(reader: str, obj: dict[str, Any]) -> float:
        elapsed = await grpcs[reader].prepare(_grpc_claim(obj))
        await grpcs[reader].unprepare(_grpc_claim(obj))
        return elapsed

    def cycle(kind: str, path: str) -> float:
        obj = objects[(kind, path)]
        if path == "rest":
            return loop.run_until_complete(rest_cycle(obj))
        how, reader = path.split("-")
        if how == "grpc":
            return loop.run_until_complete(grpc_cycle(reader, obj))
        return _kubelet_cycle(kubelets[reader], f"default/p1-{kind}-{path}")  # the claim's pod

    order = [(k, p) for k in KINDS for p in PATHS]
    sent = {reader: 0 for reader in plugins}
    for kind, path in order:  # warm-up: connections, first calls, caches
        cycle(kind, path)
        if path != "rest":
            sent[path.split("-")[1]] += 1
    times: dict[tuple[str, str], list[float]] = {key: [] for key in order}
    for i in range(samples):
        shift = i % len(order)  # rotate so no path always follows the same one
        for kind, path in order[shift:] + order[:shift]:
            times[(kind, path)].append(cycle(kind, path))
            if path != "rest":
                sent[path.split("-")[1]] += 1
    result = PrepareResult(rows={key: Stats.of(v) for key, v in times.items()})
    for reader, plugin in plugins.items():
        result.reached[reader] = (sent[reader], plugin.prepares_seen() - before[reader])
    for g in grpcs.values():
        loop.run_until_complete(g.close())
    loop.run_until_complete(client.close())
    for reader in ("memory", "apiserver"):
        plugins[reader].stop()
        kubelets[reader].close()
    return result


# --- part 2: 56 at once ----------------------------------------------------------------------


def _wait_transition(agent: AgentProcess, location: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body: dict[str, Any] = agent.request("GET", location).body
        if body["terminal"]:
            return body
        time.sleep(0.05)
    raise AssertionError(f"transition {location} did not end in {timeout}s")


def len_claims() -> int:
    return GPUS * len(SEVEN)


def _mig_names(agent: AgentProcess) -> dict[int, list[str]]:
    """Each GPU's MIG device names as the slices publish them."""
    out: dict[int, list[str]] = {}
    for item in slices_of(agent, SLICE_RULES):
        for device in item["spec"].get("devices", []):
            name = device["name"]
            if "-mig-" in name:
                out.setdefault(int(name.split("-")[1]), []).append(name)
    return {gpu: sorted(names) for gpu, names in out.items()}


def run_concurrency(loop: asyncio.AbstractEventLoop, agent: Agent, root: Path, stack: _Stack,
                    *, single_rounds: int, batches: int,
                    isolation_batches: int) -> ConcurrencyResult:
    """Part 2 (see the module docstring), through the in-memory plugin."""
    root.mkdir(parents=True, exist_ok=True)
    for gpu in range(GPUS):
        set_mig(agent.process, gpu, SEVEN)
    names = _mig_names(agent.process)
    assert sorted(names) == list(range(GPUS)) and all(len(n) == 7 for n in names.values()), names
    objects = {(gpu, i): _fake_claim(f"p2-{gpu}-{i}", name)
               for gpu, devices in names.items() for i, name in enumerate(devices)}
    memory_file = root / "claims56.json"
    memory_file.write_text(json.dumps(list(objects.values())))
    plugin = PluginProcess(root / "plugin-56", agent, reader=f"file:{memory_file}",
                           registry_dir=root / "registry-56")
    stack.add(plugin.stop)
    rpc = _Grpc(plugin.dra_socket)
    every = [_grpc_claim(o) for o in objects.values()]
    others = [_grpc_claim(o) for (gpu, _), o in objects.items() if gpu != GPUS - 1]

    async def at_once(claims: Sequence[dra_v1_pb2.Claim]) -> list[float]:
        times = await asyncio.gather(*(rpc.prepare(c) for c in claims))
        await asyncio.gather(*(rpc.unprepare(c) for c in claims))
        return list(times)

    async def one_at_a_time(claims: Sequence[dra_v1_pb2.Claim]) -> list[float]:
        out = []
        for c in claims:
            out.append(await rpc.prepare(c))
            await rpc.unprepare(c)
        return out

    loop.run_until_complete(at_once(every))  # warm-up
    single: list[float] = []
    concurrent: list[float] = []
    cpu = [0.0, 0.0, 0.0]
    for _ in range(max(single_rounds, batches)):  # interleaved
        if len(single) < single_rounds * len(every):
            single += loop.run_until_complete(one_at_a_time(every))
        if len(concurrent) < batches * len(every):
            before = (cpu_seconds(agent.process.proc.pid), cpu_seconds(plugin.proc.pid),
                      time.process_time())
            concurrent += loop.run_until_complete(at_once(every))
            after = (cpu_seconds(agent.process.proc.pid), cpu_seconds(plugin.proc.pid),
                     time.process_time())
            cpu = [c + b - a for c, a, b in zip(cpu, before, after, strict=True)]
    cycles = max(len(concurrent), 1)

    idle: list[float] = []
    busy: list[float] = []
    busy_batches = 0
    busy_s: list[float] = []
    geometries = (["3g.40gb", "2g.20gb", ONE_G, ONE_G], SEVEN)
    for round_ in range(isolation_batches):
        idle += loop.run_until_complete(at_once(others))
        reply = agent.process.request("PUT", "/v1/sim/latency", SLOW_NVML)
        assert reply.status == 200, reply.body
        reply = agent.process.request("PUT", f"/v1/gpus/{GPUS - 1}/mig", {
            "profiles": geometries[round_ % 2], "mig_enabled": True})
        assert reply.status == 202, reply.body
        location = reply.headers["location"]
        batch = loop.run_until_complete(at_once(others))
        still = not agent.process.request("GET", location).body["terminal"]
        done = _wait_transition(agent.process, location)
        assert done["state"] == "succeeded", done
        agent.process.request("PUT", "/v1/sim/latency", {})
        busy_s.append(float(done["duration_s"] or 0))
        if still:  # the whole batch ran while GPU 7 was being re-partitioned
            busy += batch
            busy_batches += 1
    loop.run_until_complete(rpc.close())
    plugin.stop()
    return ConcurrencyResult(
        single=Stats.of(single), concurrent=Stats.of(concurrent), idle=Stats.of(idle),
        busy=Stats.of(busy) if busy else Stats(0, 0.0, 0.0, 0.0), busy_batches=busy_batches,
        gpu7_busy_s=statistics.median(busy_s) if busy_s else 0.0, slow_nvml=dict(SLOW_NVML),
        cpu_per_cycle=(cpu[0] / cycles, cpu[1] / cycles, cpu[2] / cycles))


# --- part 3: republish -----------------------------------------------------------------------


def _device_names(state: dict[str, str]) -> set[str]:
    """The device names of these slice specs (JSON) a new claim may get: every device but
    those with a blocking taint (an unhealthy GPU's devices stay published, tainted)."""
    return {d["name"] for spec in state.values()
            for d in (json.loads(spec) or {}).get("devices") or []
            if not any(t.get("effect") != "None" for t in d.get("taints") or [])}


def _of_gpu(names: set[str], gpu: int) -> set[str]:
    return {n for n in names if n == f"gpu-{gpu}" or n.startswith(f"gpu-{gpu}-")}


def _gpu_shows(names: set[str], *, gpu: int, wanted: set[str]) -> bool:
    """Whether the published ``names`` of GPU ``gpu`` are exactly ``wanted``."""
    return _of_gpu(names, gpu) == wanted


def _agent_names(agent: AgentProcess) -> set[str]:
    return {d["name"] for s in slices_of(agent, SLICE_RULES)
            for d in s["spec"].get("devices") or []}


class SliceWatch:
    """A watch on the node's ResourceSlices in a thread: every event with the wall time it was
    read (``time.time()``, the clock of the agent's transition stamps)."""

    def __init__(self, server: ApiServer) -> None:
        self._server = server
        self.events: list[tuple[float, str, str, str]] = []  # (at, type, name, spec json)
        self._lock = threading.Lock()
        self._conn: http.client.HTTPSConnection | None = None
        self._stopping = threading.Event()
        status, body = server.request(
            "GET", f"{SLICES_PATH}?fieldSelector=spec.nodeName={NODE}")
        assert status == 200, body
        self.current = {s["metadata"]["name"]: json.dumps(s["spec"], sort_keys=True)
                        for s in body["items"]}
        self._version = body["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host, port = self._server.url.removeprefix("https://").rsplit(":", 1)
        context = ssl.create_default_context(cafile=str(self._server.ca))
        while not self._stopping.is_set():
            conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=600)
            self._conn = conn
            try:
                conn.request("GET", f"{SLICES_PATH}?watch=true&allowWatchBookmarks=false"
                                    f"&fieldSelector=spec.nodeName={NODE}"
                                    f"&resourceVersion={self._version}",
                             headers={"Authorization": f"Bearer {self._server.token}"})
                reply = conn.getresponse()
                for raw in reply:
                    at = time.time()
                    event = json.loads(raw)
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    self._version = meta.get("resourceVersion", self._version)
                    with self._lock:
                        self.events.append((at, event["type"], meta.get("name", ""),
                                            json.dumps(obj.get("spec"), sort_keys=True)))
            except (OSError, ValueError, http.client.HTTPException):
                if self._stopping.is_set():
                    return
                time.sleep(0.1)
            finally:
                conn.close()

    def mark(self) -> tuple[int, dict[str, str]]:
        """Where the stream is now: the events so far and the slices they add up to."""
        with self._lock:
            seen = len(self.events)
            state = dict(self.current)
            for _, kind, name, spec in self.events:
                if kind == "DELETED":
                    state.pop(name, None)
                else:
                    state[name] = spec
        return seen, state

    def first_match(self, mark: tuple[int, dict[str, str]],
                    done: Callable[[set[str]], bool], timeout: float = 30) -> float:
        """Wall time of the first event after ``mark`` from which the node's published device
        names satisfy ``done``; raises past ``timeout``."""
        seen, state = mark[0], dict(mark[1])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                fresh = self.events[seen:]
            seen += len(fresh)
            for at, kind, name, spec in fresh:
                if kind == "DELETED":
                    state.pop(name, None)
                else:
                    state[name] = spec
                if done(_device_names(state)):
                    return at
            time.sleep(0.005)
        raise AssertionError(f"the published slices did not match within {timeout}s")

    def settle(self, quiet_s: float = 1.0, timeout: float = 30) -> None:
        """Return once no event has arrived for ``quiet_s`` (the publisher is done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                last = self.events[-1][0] if self.events else 0.0
            if time.time() - last >= quiet_s:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._stopping.set()
        if self._conn is not None and self._conn.sock is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(2)
        self._thread.join(5)


def run_republish(server: ApiServer, agent: Agent, root: Path, stack: _Stack,
                  repeats: int) -> RepublishResult:
    """Part 3 (see the module docstring): the production wiring, publisher included."""
    server.ensure_node(NODE)
    plugin = PluginProcess(root / "plugin-publish", agent, reader="full",
                           registry_dir=root / "registry-publish", kubeconfig=server.kubeconfig)
    stack.add(plugin.stop)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # its first publish
        status, body = server.request(
            "GET", f"{SLICES_PATH}?fieldSelector=spec.nodeName={NODE}")
        if status == 200 and body["items"] and all(
                s["spec"].get("driver") == DRIVER for s in body["items"]):
            break
        time.sleep(0.1)
    watch = SliceWatch(server)
    stack.add(watch.stop)
    watch.settle()
    result = RepublishResult()
    gpu = 3
    geometries = (["3g.40gb", "2g.20gb", ONE_G, ONE_G], SEVEN)
    for i in range(repeats):
        mark = watch.mark()
        started = time.time()
        reply = agent.process.request("PUT", f"/v1/gpus/{gpu}/mig", {
            "profiles": geometries[i % 2], "mig_enabled": True})
        assert reply.status in (200, 202), reply.body
        ended = started
        if reply.status == 202:
            done = _wait_transition(agent.process, reply.headers["location"])
            assert done["state"] == "succeeded", done
            ended = float(done["finished_at"])
        # The slices the agent publishes for the new geometry, once in the API server (the
        # transition's drain marks republish earlier; those are steps, not the result).
        target = _of_gpu(_agent_names(agent.process), gpu)
        seen = watch.first_match(mark, partial(_gpu_shows, gpu=gpu, wanted=target))
        result.geometry.append(seen - started)
        result.geometry_after_end.append(seen - ended)
        watch.settle()
    sick = 5
    healthy = _of_gpu(_agent_names(agent.process), sick)
    assert healthy, "GPU 5 publishes no device"
    for xid in XIDS:
        for _ in range(repeats):
            mark = watch.mark()
            started = time.time()
            reply = agent.process.request("POST", "/v1/sim/xid", {"gpu": str(sick), "xid": xid})
            assert reply.status == 202, reply.body
            seen = watch.first_match(mark, partial(_gpu_shows, gpu=sick, wanted=set()))
            result.xid.setdefault(xid, []).append(seen - started)
            watch.settle()
            mark = watch.mark()
            started = time.time()
            reply = agent.process.request("POST", "/v1/sim/reset", {"gpu": str(sick)})
            assert reply.status == 204, reply.body
            seen = watch.first_match(mark, partial(_gpu_shows, gpu=sick, wanted=healthy))
            result.reset.setdefault(xid, []).append(seen - started)
            watch.settle()
    watch.stop()
    plugin.stop()
    return result


# --- part 4: allocator -----------------------------------------------------------------------


def run_allocator(root: Path, stack: _Stack, runs: int,
                  version: str = NEWEST) -> dict[str, Stats]:
    """Part 4: one claim against the agent's dgx-h100 slices (static and dynamic MIG)."""
    out: dict[str, Stats] = {}
    mig = request(device_class_name=MIG_CLASS, selectors=(f'{attr("profile")} == "{ONE_G}"',))
    cases: list[tuple[str, bool, bool, dict[str, Any]]] = [
        ("whole GPU (8 devices)", False, False, request()),
        ("static MIG 1g.10gb (56 devices)", False, True, mig),
        ("dynamic MIG 1g.10gb", True, False, mig),
    ]
    for what, dynamic, split, wanted in cases:
        started = start_node_agent(root / f"alloc-{len(out)}" / "state",
                                   extra=["--dynamic-mig"] if dynamic else [])
        stack.add(partial(started.process.stop, signal.SIGKILL))
        if split:
            for gpu in range(GPUS):
                set_mig(started.process, gpu, SEVEN)
        slices = slices_of(started.process, SLICE_RULES)
        devices = sum(len(s["spec"].get("devices", [])) for s in slices)
        times = []
        for _ in range(runs):
            answer = allocate(version, node=NODE, slices=slices, classes=classes(),
                              claims=[claim("one", wanted)])
            assert answer.allocated, answer.reason
            times.append(answer.elapsed_us / 1e6)
        label = what if not dynamic else f"{what} ({devices} devices)"
        out[label] = Stats.of(times)
        started.process.stop(signal.SIGKILL)
    return out


# --- the run and its table -------------------------------------------------------------------


def run(*, samples: int = SAMPLES, single_rounds: int = SINGLE_ROUNDS, batches: int = BATCHES,
        isolation_batches: int = ISOLATION_BATCHES, republish_repeats: int = REPUBLISH_REPEATS,
        allocator_runs: int = ALLOCATOR_RUNS,
        parts: Sequence[str] = ("prepare", "concurrency", "republish", "allocator")
        ) -> DraResult:
    """Every part, in one run on one API server (see the module docstring)."""
    result = DraResult()
    stack = _Stack()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio channels bind to the current loop when made
    with _short_dir() as root:
        try:
            server = ApiServer.start(NEWEST, root / "apiserver")
            stack.add(server.stop)
            server.ensure_node(NODE)
            if "prepare" in parts or "concurrency" in parts:
                agent = start_node_agent(root / "a" / "state")
                stack.add(lambda: agent.process.stop(signal.SIGKILL))
                if "prepare" in parts:
                    result.prepare = run_prepare(loop, server, agent, root / "p1", stack,
                                                 samples=samples)
                if "concurrency" in parts:
                    result.concurrency = run_concurrency(
                        loop, agent, root / "p2", stack, single_rounds=single_rounds,
                        batches=batches, isolation_batches=isolation_batches)
                agent.process.stop(signal.SIGKILL)
            if "republish" in parts:
                published = start_node_agent(root / "r" / "state")
                stack.add(lambda: published.process.stop(signal.SIGKILL))
                result.republish = run_republish(server, published, root / "p3", stack,
                                                 republish_repeats)
                published.process.stop(signal.SIGKILL)
            if "allocator" in parts:
                result.allocator = run_allocator(root / "p4", stack, allocator_runs)
        finally:
            stack.close()
            asyncio.set_event_loop(None)
            loop.close()
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


PATH_LABELS = {
    "rest": "REST PUT /v1/claims/{uid} (the plugin's client and body)",
    "grpc-memory": "NodePrepareResources, grpc.aio, claim from memory",
    "grpc-apiserver": "NodePrepareResources, grpc.aio, GET from kube-apiserver",
    "kubelet-memory": "kubelet's DRA manager + client, claim from memory",
    "kubelet-apiserver": "kubelet's DRA manager + client, GET from kube-apiserver",
}
KIND_LABELS = {"gpu": "whole H100", "mig": "1g.10gb"}


def report(result: DraResult) -> list[str]:
    """The table (one row per figure; ms; p50 and p99, or median and max where n is small)."""
    lines = [f"# DRA: kubelet plugin, prepares at once, republish, allocator; simulated "
             f"{PRESET}, kube-apiserver {result.version}; {machine()}",
             f"{'measurement':<74} {'n':>5} {'p50 ms':>9} {'p99 ms':>9}  goal"]

    def row(label: str, stats: Stats, goal: str = "", *, worst: bool = False) -> None:
        high = stats.max if worst else stats.p99
        lines.append(f"{label:<74} {stats.n:>5} {_ms(stats.p50):>9} {_ms(high):>9}  {goal}")

    p = result.prepare
    if p is not None:
        for kind in KINDS:
            for path in PATHS:
                goal = ""
                if path == "grpc-memory":
                    hop = p.hop(kind)
                    goal = (f"hop over REST {_ms(hop)} ms at p50 <= 1 ms: "
                            f"{_yes(hop <= HOP_GOAL_S)}")
                row(f"prepare {KIND_LABELS[kind]}: {PATH_LABELS[path]}", p.rows[(kind, path)],
                    goal)
        reached = ", ".join(f"{reader} plugin {seen} of {sent} sent"
                            for reader, (sent, seen) in p.reached.items())
        lines.append(f"  prepares that reached the plugin (its own count): {reached}")
    c = result.concurrency
    if c is not None:
        row("56 MIG claims (8 GPUs x 7 1g.10gb), one prepare at a time", c.single)
        row("56 MIG claims, all 56 prepares at once (one call each)", c.concurrent,
            f"p99 {c.ratio:.2f}x one at a time <= 3x: {_yes(c.ratio <= 3)}; max "
            f"{_ms(c.concurrent.max)} ms vs NVIDIA's 10 s lock timeout", worst=False)
        agent_cpu, plugin_cpu, client_cpu = c.cpu_per_cycle
        lines.append(f"  CPU per prepare+unprepare at 56 at once: agent {_ms(agent_cpu)} ms, "
                     f"plugin {_ms(plugin_cpu)} ms, client {_ms(client_cpu)} ms: 56 need "
                     f">= {_ms(c.cpu_floor_s)} ms of the {os.cpu_count()} cores")
        row("49 claims of GPUs 0-6 at once, GPU 7 idle", c.idle)
        busy_ratio = c.busy.p99 / c.idle.p99 if c.busy.n and c.idle.p99 else float("nan")
        row(f"49 claims of GPUs 0-6 at once, GPU 7 re-partitioning ({c.gpu7_busy_s:.1f} s)",
            c.busy, f"p99 {busy_ratio:.2f}x idle; {c.busy_batches} batches inside the "
                    "transition")
        slow = ", ".join(f"{k.removeprefix('nvml')} {v:g} s" for k, v in c.slow_nvml.items())
        lines.append(f"  GPU 7's NVML mutations slowed by the simulator: {slow}")
    r = result.republish
    if r is not None:
        changes = [("republish: MIG geometry change, PUT -> slice in the API server",
                    r.geometry),
                   ("republish: MIG geometry change, transition end -> slice",
                    r.geometry_after_end)]
        for xid in sorted(r.xid):
            changes += [(f"republish: XID {xid} (GPU unhealthy) -> slice", r.xid[xid]),
                        (f"republish: reset after XID {xid} (healthy) -> slice",
                         r.reset.get(xid, []))]
        for label, values in changes:
            if values:
                stats = Stats.of(values)
                row(f"{label} (median, max)", stats,
                    f"<= 2 s: {_yes(stats.max <= REPUBLISH_GOAL_S)}", worst=True)
    for label, stats in result.allocator.items():
        row(f"allocator {result.version}, one claim: {label} (median, max)", stats, worst=True)
    return lines


def main() -> None:
    for line in report(run()):
        print(line)


if __name__ == "__main__":
    main()
