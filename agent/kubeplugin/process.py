"""The ``gpu-agent kubelet-plugin`` process: the gRPC servers kubelet calls, the health
listener, and the ResourceSlice publisher, until SIGTERM.

Kubernetes comes in through :func:`wire_kubernetes`, the one place that builds the concrete
API server client and publisher; everything else sees them through the Protocols of
:mod:`agent.kubeplugin.protocols`, so the tests run the same process with fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.kubeplugin.agent_client import AgentClient, token_file_usable
from agent.kubeplugin.claim_reads import READ_TIMEOUT_S, READS_AT_ONCE
from agent.kubeplugin.claim_status import WRITES_AT_ONCE, ClaimStatusWriter
from agent.kubeplugin.credentials import (
    CredentialProbe,
    follow_agent_token,
    follow_api_credential,
)
from agent.kubeplugin.device_health import DeviceHealthView
from agent.kubeplugin.domain_explainer import INTERVAL_S as EXPLAIN_INTERVAL_S
from agent.kubeplugin.domain_explainer import LEASE as EXPLAINER_LEASE
from agent.kubeplugin.domain_explainer import DomainExplainer
from agent.kubeplugin.domain_slots import DomainSlots
from agent.kubeplugin.domains import DomainMembership
from agent.kubeplugin.dra import DraService
from agent.kubeplugin.health import HealthServer, Readiness, parse_listen
from agent.kubeplugin.health_stream import HealthStreams
from agent.kubeplugin.kube import KubeClient, KubeConfigMissing
from agent.kubeplugin.lease import DURATION_S as LEASE_DURATION_S
from agent.kubeplugin.lease import LeaderElection
from agent.kubeplugin.metrics import PluginMetrics
from agent.kubeplugin.miglabels import MigLabels, settings_problem
from agent.kubeplugin.protocols import ApiServer, ClaimReader, Publisher
from agent.kubeplugin.publisher import ResourceSlicePublisher
from agent.kubeplugin.servers import PluginServers, RegistrationState, SocketPathError

log = logging.getLogger("agent.kubeplugin")

DEFAULT_DRIVER = "gpu.nodeagent.dev"
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_HEALTH_LISTEN = "127.0.0.1:9478"
#: How long calls in progress may finish after SIGTERM (a DaemonSet's default grace is 30 s).
STOP_GRACE_S = 10.0
#: A publisher that fails is started again after this long.
PUBLISHER_RESTART_S = 5.0
#: Connections for compute-domain membership: one watch per domain (one at a time) and its
#: patches.
DOMAIN_CONNECTIONS = 4
#: How long the stop waits for claim status writes still wanted (an unprepare's removal).
STATUS_FLUSH_S = 2.0


class PluginStartError(Exception):
    """The plugin cannot start: a one-line reason for the operator."""


#: A Node's name: a DNS-1123 subdomain.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")

@dataclass(frozen=True)
class PluginSettings:
    """The command line of ``gpu-agent kubelet-plugin``."""

    agent_socket: Path
    token_file: Path
    node_name: str
    driver: str = DEFAULT_DRIVER
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    kubeconfig: Path | None = None
    health_listen: str = DEFAULT_HEALTH_LISTEN
    agent_lost_after_s: float = 60.0
    claim_read_timeout_s: float = READ_TIMEOUT_S
    #: mig-manager's node labels (docs/mig.md), off unless a ConfigMap is named.
    mig_config_map: str | None = None
    mig_token_file: Path | None = None
    mig_allow_reset: bool = False
    #: The namespace of the Lease whose holder explains unplaceable compute domains (None:
    #: this plugin never explains them).
    lease_namespace: str | None = None
    explain_interval_s: float = EXPLAIN_INTERVAL_S
    #: How long a Lease nobody renews stays its holder's (it is read every quarter of it).
    lease_duration_s: float = LEASE_DURATION_S

    def check(self) -> None:
        """Refuse settings that cannot work, naming the flag."""
        if not self.node_name:
            raise PluginStartError("--node-name (or NODE_NAME) is required")
        if not self.driver or "/" in self.driver:
            raise PluginStartError(f"--driver {self.driver!r}: a DNS subdomain, no '/'")
        if not _NODE_NAME.match(self.node_name) or len(self.node_name) > 253:
            raise PluginStartError(f"--node-name {self.node_name[:80]!r}: a DNS-1123 subdomain "
                                   "(it goes into API paths and field selectors)")
        if self.agent_lost_after_s <= 0:
            raise PluginStartError("--agent-lost-after must be above 0 seconds")
        if self.lease_namespace is not None and not _NAMESPACE.match(self.lease_namespace):
            raise PluginStartError(f"--lease-namespace {self.lease_namespace[:80]!r}: a "
                                   "namespace name (a DNS-1123 label)")
        if not 4 <= self.lease_duration_s <= 3600:
            raise PluginStartError("--lease-duration must be 4 to 3600 seconds")
        if not 0 < self.explain_interval_s <= 3600:
            raise PluginStartError("--domain-explain-interval must be above 0 and at most "
                                   "3600 seconds")
        if not 0 < self.claim_read_timeout_s <= 300:
            raise PluginStartError("--claim-read-timeout must be above 0 and at most 300 "
                                   "seconds")
        try:
            parse_listen(self.health_listen)
        except ValueError as err:
            raise PluginStartError(str(err)) from None
        problem = token_file_usable(self.token_file) or settings_problem(
            self.mig_config_map, self.mig_token_file)
        if problem is not None:
            raise PluginStartError(problem)


@dataclass
class Wiring:
    """The Kubernetes side: how claims are read, how the API server is probed, the publisher
    (None: slices are not published by this process), and what to close at the end."""

    claims: ClaimReader
    api: ApiServer | None = None
    publisher: Publisher | None = None
    close: Callable[[], Awaitable[None]] | None = None
    #: mig-manager's node labels (None: the mode is off).
    mig_labels: MigLabels | None = None
    #: Each device's health as the publisher last saw the agent render it (None: no
    #: publisher here, so every device is Unknown to kubelet's health stream).
    device_health: DeviceHealthView | None = None
    #: Writes the claims' device status (None: not written by this process).
    claim_status: ClaimStatusWriter | None = None
    #: Checks the API server credential at start and while refused (None: not checked).
    credential: CredentialProbe | None = None
    #: This node's compute-domain membership (None: compute-domain claims are refused).
    domains: DomainMembership | None = None
    #: Publishes the node's compute-domain slot that the publisher hands over (None: not
    #: published by this process).
    domain_slots: DomainSlots | None = None
    #: Explains unplaceable compute domains while this plugin holds the Lease (None: off).
    explaining: Callable[[], Awaitable[None]] | None = None


Wire = Callable[[PluginSettings, AgentClient, CollectorRegistry], Awaitable[Wiring]]


async def wire_kubernetes(settings: PluginSettings, agent: AgentClient,
                          registry: CollectorRegistry) -> Wiring:
    """The real Kubernetes side: the API server client (in-cluster, or ``--kubeconfig``) as
    claim reader and API probe, and the ResourceSlice publisher on the same client."""
    try:
        kube = await KubeClient.from_environment(settings.kubeconfig,
                                                 node_name=settings.node_name)
    except KubeConfigMissing as err:
        raise PluginStartError(str(err)) from None
    claims = kube.sibling(connections=READS_AT_ONCE)
    slots = DomainSlots(kube, node_name=settings.node_name, driver=settings.driver)
    publisher = ResourceSlicePublisher(agent, kube, node_name=settings.node_name,
                               driver=settings.driver,
                               agent_lost_after_s=settings.agent_lost_after_s,
                               registry=registry, on_slot=slots.want)
    # Its own connections: status writes never wait behind claim reads or slice writes.
    statuses = kube.sibling(connections=WRITES_AT_ONCE)
    writer = ClaimStatusWriter(statuses, publisher.device_health, driver=settings.driver,
                               pool=settings.node_name, registry=registry, agent=agent)
    # Its own connections too: a domain's member watch holds one while the claim is here.
    members = kube.sibling(connections=DOMAIN_CONNECTIONS)
    domains = DomainMembership(members, agent, node_name=settings.node_name,
                               registry=registry)
    explaining: Callable[[], Awaitable[None]] | None = None
    if settings.lease_namespace is not None:
        election = LeaderElection(kube, namespace=settings.lease_namespace, name=EXPLAINER_LEASE,
                                  identity=settings.node_name,
                                  duration_s=settings.lease_duration_s,
                                  retry_s=settings.lease_duration_s / 4)
        explainer = DomainExplainer(kube, driver=settings.driver, node_name=settings.node_name,
                                    registry=registry, interval_s=settings.explain_interval_s)

        async def explaining() -> None:
            await election.run(explainer.run)
    labels: MigLabels | None = None
    if settings.mig_config_map is not None and settings.mig_token_file is not None:
        try:
            labels = await MigLabels.open(
                kubeconfig=settings.kubeconfig, agent_socket=settings.agent_socket,
                token_file=settings.mig_token_file, node_name=settings.node_name,
                config_map=settings.mig_config_map, allow_reset=settings.mig_allow_reset)
        except KubeConfigMissing as err:
            for client in (members, statuses, claims, kube):
                await client.close()
            raise PluginStartError(str(err)) from None

    async def close() -> None:
        if labels is not None:
            await labels.close()
        for client in (members, statuses, claims, kube):
            await client.close()

    return Wiring(claims=claims, api=kube, publisher=publisher, close=close, mig_labels=labels,
                  device_health=publisher.device_health, claim_status=writer, credential=kube,
                  domains=domains, domain_slots=slots, explaining=explaining)


@dataclass
class Plugin:
    """One running plugin: start, then stop (both idempotent in order)."""

    settings: PluginSettings
    wiring: Wiring
    agent: AgentClient
    registry: CollectorRegistry
    registration: RegistrationState = field(default_factory=RegistrationState)
    # Built from the fields above (__post_init__):
    service: DraService = field(init=False)
    servers: PluginServers = field(init=False)
    health: HealthServer = field(init=False)
    # Running while started:
    _publishing: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _labelling: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _status_writing: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _slotting: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _checking: list[asyncio.Task[None]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        metrics = PluginMetrics(self.registry)
        self.service = DraService(self.agent, self.wiring.claims, driver=self.settings.driver,
                                  node_name=self.settings.node_name, metrics=metrics,
                                  read_timeout_s=self.settings.claim_read_timeout_s,
                                  status=self.wiring.claim_status,
                                  domains=self.wiring.domains)
        self.servers = PluginServers(self.service, driver=self.settings.driver,
                                     registry_dir=self.settings.registry_dir,
                                     plugins_dir=self.settings.plugins_dir,
                                     registration=self.registration, metrics=metrics,
                                     health=HealthStreams(
                                         self.wiring.device_health or DeviceHealthView(),
                                         self.agent))
        self.health = HealthServer(self.settings.health_listen, Readiness(
            self.registration, self.agent, self.wiring.api, self.wiring.publisher,
            metrics=metrics, claim_status=self.wiring.claim_status,
            credential=self.wiring.credential, domain_slots=self.wiring.domain_slots),
            self.registry)

    async def start(self) -> None:
        try:
            await self.health.start()
            await self.servers.start()
        except (SocketPathError, OSError) as err:
            await self.stop()
            raise PluginStartError(str(err)) from err
        # Both credentials are checked before anything needs them (credentials.py).
        self._checking.append(asyncio.create_task(follow_agent_token(self.agent)))
        probe = self.wiring.credential
        if probe is not None and probe.credential is not None:
            self._checking.append(asyncio.create_task(follow_api_credential(probe)))
        if self.wiring.publisher is not None:
            self._publishing = asyncio.create_task(self._publish(self.wiring.publisher))
        if self.wiring.domain_slots is not None:
            self._slotting = asyncio.create_task(self._restarting(
                "the compute-domain slot", self.wiring.domain_slots.run))
        if self.wiring.mig_labels is not None:
            self._labelling = asyncio.create_task(self.wiring.mig_labels.run())
        if self.wiring.claim_status is not None:
            self._status_writing = asyncio.create_task(
                self._write_status(self.wiring.claim_status))
        if self.wiring.explaining is not None:
            self._checking.append(asyncio.create_task(self._restarting(
                "the compute-domain explainer", self.wiring.explaining)))
        if self.wiring.domains is not None:
            self._checking.append(asyncio.create_task(self._recover_domains(
                self.wiring.domains)))

    async def _recover_domains(self, domains: DomainMembership) -> None:
        """Follow again the domain this node announces itself in (retried until read)."""
        delay = 0.2
        while True:
            try:
                await domains.recover()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("reading this node's compute-domain membership failed; retrying",
                            extra={"error": str(err), "retry_in_s": delay})
            await asyncio.sleep(delay)
            delay = min(delay * 2, PUBLISHER_RESTART_S)

    async def _publish(self, publisher: Publisher) -> None:
        while True:
            try:
                await publisher.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the ResourceSlice publisher failed; restarting it",
                              extra={"restart_in_s": PUBLISHER_RESTART_S})
                await asyncio.sleep(PUBLISHER_RESTART_S)

    async def _restarting(self, what: str, run: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: its state is kept, its loops start again
                log.exception(f"{what} failed; restarting it",
                              extra={"restart_in_s": PUBLISHER_RESTART_S})
                await asyncio.sleep(PUBLISHER_RESTART_S)

    async def _write_status(self, writer: ClaimStatusWriter) -> None:
        while True:
            try:
                await writer.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: the writer's state is kept, its loops start again
                log.exception("the claim status writer failed; restarting it",
                              extra={"restart_in_s": PUBLISHER_RESTART_S})
                await asyncio.sleep(PUBLISHER_RESTART_S)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Deregister from kubelet, let claim calls in progress finish (up to ``grace_s``),
        stop publishing, close everything; the socket files are removed."""
        await self.servers.stop(grace_s)
        await self.service.drain(grace_s)
        await self.service.close()
        if self._status_writing is not None and self.wiring.claim_status is not None:
            await self.wiring.claim_status.flush(STATUS_FLUSH_S)
            self._status_writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_writing
            self._status_writing = None
        if self._slotting is not None:
            self._slotting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._slotting
            self._slotting = None
        if self._publishing is not None:
            self._publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publishing
            self._publishing = None
        for task in self._checking:
            task.cancel()
        for task in self._checking:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._checking.clear()
        if self.wiring.domains is not None:
            await self.wiring.domains.close()
        if self._labelling is not None:
            self._labelling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._labelling
            self._labelling = None
        await self.health.stop()
        if self.wiring.close is not None:
            await self.wiring.close()
        await self.agent.close()


async def serve(settings: PluginSettings, wire: Wire = wire_kubernetes) -> int:
    """Run the plugin until SIGTERM or SIGINT; the exit status."""
    settings.check()
    registry = CollectorRegistry()
    agent = AgentClient(settings.agent_socket, settings.token_file)
    try:
        wiring = await wire(settings, agent, registry)
    except BaseException:
        await agent.close()
        raise
    plugin = Plugin(settings, wiring, agent, registry)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await plugin.start()
        log.info("kubelet plugin started", extra={
            "driver": settings.driver, "node": settings.node_name,
            "agent_socket": str(settings.agent_socket),
            "health": "{}:{}".format(*plugin.health.address) if plugin.health.address else ""})
        await stopping.wait()
        log.info("stopping")
        await plugin.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0
