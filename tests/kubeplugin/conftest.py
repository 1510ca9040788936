"""A real agent process (``--simulate dgx-h100``) and the kubelet plugin in this test's event
loop, driven by kubelet's side of the protocol: a grpc.aio channel on the plugin's Unix sockets
with the generated stubs. ResourceClaims come from an in-memory :class:`FakeClaims` (a real
API server replaces it in the Kubernetes harness tests). The publisher's tests meet the real
kube-apiserver of tests/k8s (``kube_apiserver``, ``kube_apiservers``)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.process import Plugin, PluginSettings, Wiring
from agent.kubeplugin.proto import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    registration_pb2_grpc,
)
from tests.agent_process import AgentProcess, start_agent
from tests.k8s.fixtures import kube_apiserver, kube_apiservers

__all__ = ["kube_apiserver", "kube_apiservers"]

DRIVER = "gpu.nodeagent.dev"
NODE = "node-a"

def result(device: str, request: str = "gpu", *, driver: str = DRIVER, pool: str = NODE,
           admin: bool = False) -> dict[str, Any]:
    """One ``status.allocation.devices.results`` entry."""
    out: dict[str, Any] = {"request": request, "driver": driver, "pool": pool,
                           "device": device}
    if admin:
        out["adminAccess"] = True
    return out


def resource_claim(name: str, uid: str, results: list[dict[str, Any]] | None, *,
                   namespace: str = "default", resource_version: str = "7") -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` ResourceClaim as the API server answers it (``results`` None:
    not allocated)."""
    status: dict[str, Any] = {}
    if results is not None:
        status["allocation"] = {"devices": {"results": results}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "resourceVersion": resource_version},
            "spec": {"devices": {"requests": []}}, "status": status}


@dataclass
class Hold:
    """Reads of one claim wait for ``release``; ``reached`` is set once one is waiting."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    reached: asyncio.Event = field(default_factory=asyncio.Event)


class FakeClaims:
    """The API server's ResourceClaims, in memory; a claim may be held back (its reads wait)
    to order calls in a test."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.held: dict[str, Hold] = {}
        self.version: tuple[int, int] = (1, 37)
        self.down = False

    def add(self, name: str, results: list[dict[str, Any]] | None, *,
            uid: str | None = None, namespace: str = "default") -> dra_v1_pb2.Claim:
        """Store a claim; kubelet's ``Claim`` naming it."""
        uid = uid or f"uid-{name}-{secrets.token_hex(4)}"
        self.objects[(namespace, name)] = resource_claim(name, uid, results,
                                                         namespace=namespace)
        return dra_v1_pb2.Claim(namespace=namespace, name=name, uid=uid)

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        hold = self.held.get(name)
        if hold is not None:
            hold.reached.set()
            await hold.release.wait()
        try:
            return copy.deepcopy(self.objects[(namespace, name)])
        except KeyError:
            raise LookupError(f"resourceclaims {namespace}/{name} not found") from None

    async def server_version(self) -> tuple[int, int]:
        if self.down:
            raise ConnectionRefusedError("API server down")
        return self.version


@dataclass
class FakePublisher:
    in_sync: bool = True
    reason: str | None = None
    withheld: str | None = None
    runs: int = 0

    async def run(self) -> None:
        self.runs += 1
        await asyncio.Event().wait()

    def health(self) -> FakePublisher:
        return self


@dataclass
class Kubelet:
    """Kubelet's clients of the running plugin."""

    plugin: Plugin
    claims: FakeClaims
    publisher: FakePublisher
    registration: Any
    v1: Any
    v1beta1: Any
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    async def prepare(self, *claims: Any, version: str = "v1",
                      deadline_s: float = 30) -> dict[str, Any]:
        """NodePrepareResources for ``claims``: the answer's map by UID."""
        stub, pb2 = (self.v1, dra_v1_pb2) if version == "v1" else (self.v1beta1,
                                                                   dra_v1beta1_pb2)
        request = pb2.NodePrepareResourcesRequest(claims=[
            pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        answer = await stub.NodePrepareResources(request, timeout=deadline_s)
        return dict(answer.claims)

    async def unprepare(self, *claims: Any, deadline_s: float = 30) -> dict[str, str]:
        request = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=list(claims))
        answer = await self.v1.NodeUnprepareResources(request, timeout=deadline_s)
        return {uid: entry.error for uid, entry in answer.claims.items()}

    @property
    def health_url(self) -> str:
        assert self.plugin.health.address is not None
        host, port = self.plugin.health.address
        return f"http://{host}:{port}"


@pytest.fixture(autouse=True)
def plugin_logs_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """Every log line the plugin writes in production is formatted in the tests too."""
    caplog.set_level(logging.INFO, logger="agent.kubeplugin")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket path holds at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@dataclass
class Agent:
    """The agent process, and the claims-scoped token the plugin uses."""

    process: AgentProcess
    plugin_token: str
    token_file: Path


def start_with_plugin_token(state: Path, *, node: str = NODE, **kwargs: Any) -> Agent:
    """Start an agent for ``node`` whose token file has an admin token (the tests' own, first
    line) and a ``plugin`` token of the ``claims`` scope only, as the DaemonSet gives the
    plugin."""
    state.mkdir(parents=True, exist_ok=True)
    admin, plugin = secrets.token_hex(16), secrets.token_hex(16)
    write_private(state / "tokens", f"admin:{admin}\nplugin:{plugin}:claims\n")
    process = start_agent(state, extra=["--node-name", node,
                                        "--token-file", str(state / "tokens"),
                                        *kwargs.pop("extra", [])], **kwargs)
    process.token = admin  # start_agent reads only a one-line token file right
    token_file = write_private(state.parent / "plugin.token", plugin + "\n")
    return Agent(process, plugin, token_file)


@pytest.fixture
def agent(short_dir: Path) -> Iterator[Agent]:
    running = start_with_plugin_token(short_dir / "state")
    yield running
    running.process.stop(signal.SIGKILL)


def settings_for(root: Path, agent: Agent) -> PluginSettings:
    return PluginSettings(agent_socket=agent.process.socket_path, token_file=agent.token_file,
                          node_name=NODE, driver=DRIVER, registry_dir=root / "registry",
                          plugins_dir=root / "plugins", health_listen="127.0.0.1:0")


async def open_kubelet(settings: PluginSettings, claims: FakeClaims | None = None,
                       publisher: FakePublisher | None = None, *,
                       claim_timeout_s: float | None = None) -> Kubelet:
    """Start the plugin in this loop and connect kubelet's clients to its two sockets
    (``claim_timeout_s``: how long the plugin waits for the agent's answer to a claim)."""
    claims = claims or FakeClaims()
    publisher = publisher or FakePublisher()
    client = AgentClient(settings.agent_socket, settings.token_file) if claim_timeout_s is None \
        else AgentClient(settings.agent_socket, settings.token_file,
                         claim_timeout_s=claim_timeout_s)
    plugin = Plugin(settings, Wiring(claims=claims, api=claims, publisher=publisher), client,
                    CollectorRegistry())
    await plugin.start()
    reg = grpc.aio.insecure_channel(f"unix://{plugin.servers.registration_socket}")
    dra = grpc.aio.insecure_channel(f"unix://{plugin.servers.dra_socket}")
    return Kubelet(plugin, claims, publisher, registration_pb2_grpc.RegistrationStub(reg),
                   dra_v1_pb2_grpc.DRAPluginStub(dra), dra_v1beta1_pb2_grpc.DRAPluginStub(dra),
                   [reg, dra])


async def close_kubelet(kubelet: Kubelet) -> None:
    for channel in kubelet.channels:
        await channel.close()
    await kubelet.plugin.stop(grace_s=1)


@pytest.fixture
async def kubelet(short_dir: Path, agent: Agent) -> AsyncIterator[Kubelet]:
    running = await open_kubelet(settings_for(short_dir, agent))
    yield running
    await close_kubelet(running)


class NodeAgents:
    """Simulated agents for named nodes (each with the plugin's ``claims`` token), stopped at
    the end of the test; one may be stopped and started again on its state."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._running: list[Agent] = []

    def start(self, node: str, *, preset: str = "dgx-h100", dynamic_mig: bool = False,
              extra: tuple[str, ...] = ()) -> Agent:
        state = self._root / f"a{len(self._running)}" / "state"
        agent = start_with_plugin_token(state, node=node, preset=preset,
                                        extra=["--driver-name", DRIVER,
                                               *(["--dynamic-mig"] if dynamic_mig else []),
                                               *extra])
        self._running.append(agent)
        return agent

    def restart(self, agent: Agent) -> Agent:
        """The same agent (command line, state, tokens) started again after a stop."""
        args = agent.process.args
        # start_agent's own part: python -m agent serve --state-dir S --listen T --listen U
        assert args[3] == "serve" and args[8] == "--listen", args
        process = start_agent(agent.process.state_dir, preset=None, extra=args[10:])
        process.token = agent.process.token
        again = Agent(process, agent.plugin_token, agent.token_file)
        self._running.append(again)
        return again

    def stop_all(self) -> None:
        for agent in self._running:
            agent.process.stop(signal.SIGKILL)


@pytest.fixture
def node_agent(short_dir: Path) -> Iterator[NodeAgents]:
    agents = NodeAgents(short_dir)
    yield agents
    agents.stop_all()
