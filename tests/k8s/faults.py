"""What the fault tests (tests/k8s/test_faults_*.py) share: the real stack of tests/k8s/stack.py,
optionally with the plugin reaching the API server through an :class:`ApiServerLink` the test
can cut or hold; claims allocated in the server; calls left running while a test breaks
something; the simulator's NVML controls."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.k8s.harness import ApiServer, allocate_in_cluster
from tests.k8s.link import ApiServerLink
from tests.k8s.objects import DRIVER, claim, pod, request
from tests.k8s.stack import DEVICE_CLASSES, Stack, apply_shipped, wait_for

Json = dict[str, Any]
T = TypeVar("T")
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
GPU_CLASS = "gpu.nodeagent.dev"
DYNAMIC_MIG_CLASS = "dynamic-mig.nodeagent.dev"
#: Kubelet's start-up wipe of the node's slices is one GET and one DELETE away from its start.
SETTLE_S = 1.5


class FaultStack(Stack):
    """A :class:`Stack` whose plugin may reach the API server through ``link``."""

    link: ApiServerLink | None = None

    def close(self) -> None:
        super().close()
        if self.link is not None:
            self.link.close()


StartFaultStack = Callable[..., FaultStack]


@pytest.fixture
def fault_stack() -> Iterator[StartFaultStack]:
    """``start(server, preset, node=..., link=False, dynamic_mig=False, agent_extra=(),
    plugin_extra=(), kubelet=True)``: agent, plugin and kubelet harness as the ``stack``
    fixture starts them; with ``link`` the plugin's kubeconfig names an
    :class:`ApiServerLink` to the server (kubelet and the test still talk to the server
    directly). Waits until the plugin is ready (registered, slices published)."""
    started: list[FaultStack] = []
    roots: list[Path] = []

    def start(server: ApiServer, preset: str, *, node: str, link: bool = False,
              dynamic_mig: bool = False, agent_extra: Sequence[str] = (),
              plugin_extra: Sequence[str] = (), kubelet: bool = True) -> FaultStack:
        # <plugins dir>/<driver>/dra.sock must fit a Unix socket path's 107 bytes.
        root = Path(tempfile.mkdtemp(prefix="faults-", dir="/tmp"))
        roots.append(root)
        stack = FaultStack(server, node, root, preset,
                           [*(["--dynamic-mig"] if dynamic_mig else []), *agent_extra],
                           list(plugin_extra), server.version, "")
        started.append(stack)
        if link:
            stack.link = ApiServerLink(server.url).start()
            stack.kubeconfig = stack.link.kubeconfig(stack.kubeconfig,
                                                     root / "plugin-via-link.kubeconfig")
        stack.start_agent()
        stack.start_plugin()
        if kubelet:
            stack.start_kubelet()
            stack.plugin.wait_ready()
        settle(stack)
        return stack

    yield start
    for stack in started:
        stack.close()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def slice_uids(stack: Stack) -> dict[str, str]:
    """The node's slices in the server: name -> UID."""
    return {s["metadata"]["name"]: s["metadata"]["uid"] for s in stack.resource_slices()}


def settle(stack: Stack, quiet_s: float = SETTLE_S, timeout: float = 30) -> dict[str, str]:
    """Wait until the node's slices are published and unchanged for ``quiet_s``: kubelet
    wipes them from a goroutine of its own after it starts, which may come after the
    plugin's first publish (and the plugin's /readyz says in sync until it has seen the
    deletion). The slices' UIDs by name."""
    seen, since = slice_uids(stack), time.monotonic()

    def quiet() -> dict[str, str] | None:
        nonlocal seen, since
        now = slice_uids(stack)
        if now != seen or not now:
            seen, since = now, time.monotonic()
            return None
        return now if time.monotonic() - since >= quiet_s else None
    return wait_for(f"slices of {stack.node} unchanged for {quiet_s}s", quiet, timeout,
                    interval=0.1, log=stack.plugin.log)


# --- claims in the API server ------------------------------------------------------------


def allocated_claim(server: ApiServer, name: str, node: str, *requests: Json) -> tuple[str, str]:
    """A ResourceClaim and a Pod ``name`` on ``node`` using it, allocated by the scheduler's
    allocator from the published slices and reserved for the pod: (claim UID, device)."""
    apply_shipped(server, DEVICE_CLASSES)
    wanted = claim(name, *(requests or (request(device_class_name=GPU_CLASS),)))
    wanted["metadata"].pop("uid")
    server.apply([wanted, pod(name, {"c": name}, node_name=node)])
    answer = allocate_in_cluster(server, node=node, claims=[f"default/{name}"],
                                 pod=f"default/{name}")
    assert answer.allocated, answer.reason
    [device] = answer.devices()
    status, stored = server.request("GET", f"{CLAIMS}/{name}")
    assert status == 200, stored
    return str(stored["metadata"]["uid"]), device


def cdi_id(uid: str, device: str) -> str:
    """The CDI device the agent names for one device of a claim (docs/claims.md, CDI)."""
    return f"k8s.{DRIVER}/claim={uid}-{device}"


def in_background(call: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run ``call`` in a thread (a kubelet call the test breaks something under); its
    future. The pool does not outlive the call."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="in-flight")
    try:
        return pool.submit(call)
    finally:
        pool.shutdown(wait=False)


def timed(what: str, probe: Callable[[], Any], timeout: float,
          log: Callable[[], str] | None = None) -> float:
    """Seconds until ``probe()`` is truthy (AssertionError after ``timeout``)."""
    started = time.monotonic()
    wait_for(what, probe, timeout, interval=0.05, log=log)
    return time.monotonic() - started


# --- the agent and its simulator ---------------------------------------------------------


def sim_calls(agent: AgentProcess, function: str) -> int:
    """How often the simulated NVML function has been called since the agent started."""
    reply = agent.request("GET", "/v1/sim")
    assert reply.status == 200, reply.body
    return int(reply.body["calls"].get(function, 0))


def set_latency(agent: AgentProcess, latencies: dict[str, float]) -> None:
    reply = agent.request("PUT", "/v1/sim/latency", latencies)
    assert reply.status == 200, reply.body


def add_fault(agent: AgentProcess, function: str, error: str) -> None:
    reply = agent.request("POST", "/v1/sim/faults", {"function": function, "error": error})
    assert reply.status == 201, reply.body


def start_agent_unready(stack: Stack, faults: list[Json]) -> AgentProcess:
    """Start the stack's agent again (same state dir and flags) with simulator faults armed
    before NVML is first touched, without waiting for it to be ready."""
    previous = stack.agent.args
    extra = previous[previous.index("--simulate") + 2:]
    stack.agent = start_agent(stack.agent_dir, preset=stack.preset, extra=extra,
                              env={"GPU_AGENT_SIM_FAULTS": json.dumps(faults)},
                              wait_ready=False)
    return stack.agent


def mig_devices(agent: AgentProcess, gpu: int) -> list[Json]:
    """The MIG devices GPU ``gpu`` has now (``GET /v1/gpus/{gpu}``)."""
    reply = agent.request("GET", f"/v1/gpus/{gpu}")
    assert reply.status == 200, reply.body
    return list(reply.body.get("mig_devices") or [])


def gpu_of(device: str) -> int:
    """The GPU index of a ResourceSlice device name (``gpu-<minor>[-mig-...]``; the simulator
    numbers minors as indices)."""
    return int(device.split("-")[1])


def kill_when(agent_or_plugin_stop: Callable[[int], int], ready: Callable[[], bool],
              what: str, timeout: float = 30) -> None:
    """SIGKILL (through ``agent_or_plugin_stop``) once ``ready()`` holds."""
    wait_for(what, ready, timeout, interval=0.02)
    agent_or_plugin_stop(signal.SIGKILL)
