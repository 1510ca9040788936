"""One wiring: :func:`build_node` builds the node's services from settings and an NVML backend,
and :class:`Node` starts and stops them. The daemon, the benchmarks and the tests all build
the node this way, so what they exercise is what runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_exponential_jitter

import agent
from agent.claims.attribution import claim_attribution, share_attribution
from agent.claims.cdi_writer import CdiWriter, agent_id
from agent.claims.checkpoint import ClaimCheckpoint
from agent.claims.service import ClaimService
from agent.claims.sharing_runtime import SharingRuntime
from agent.claims.signals import ClaimSampler
from agent.domains.service import DomainService, ImexSettings
from agent.dra.service import ResourceSliceService
from agent.errors import AgentError, NvmlError, StorageUnavailable
from agent.events import EventLog, Severity
from agent.gpu.backend import Backend
from agent.gpu.imex import ImexControl
from agent.gpu.inventory import GpuInventory
from agent.gpu.mps import MpsControl, mps_processes
from agent.gpu.nvidia_smi import NvidiaSmi
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.xid import XidWatcher
from agent.health.report import PlacedTaint, TaintId, changes, node_taints
from agent.host import boot_id
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics
from agent.metrics.claims import ClaimMetrics
from agent.metrics.collector import Collector
from agent.metrics.health import GpuHealth
from agent.mig.devices import MigDevices
from agent.mig.journal import TransitionJournal
from agent.mig.service import MigService
from agent.mps.direct import DirectLauncher
from agent.mps.host_client import HostLauncher
from agent.mps.launch import MpsLauncher
from agent.podresources.poller import PodResourcesPoller
from agent.readiness import Readiness
from agent.settings import Settings
from agent.topology.service import TopologyService

log = logging.getLogger("agent.node")

#: The deadline of one PodResources call to kubelet: a busy node's kubelet can take a second;
#: the poller runs in its own task, so a slow answer delays only the next poll.
POD_RESOURCES_TIMEOUT_S = 5.0
#: How often the claims' MPS daemons are checked: a daemon that died is reported (event,
#: claim ``mps.state``) within this long.
MPS_SUPERVISE_INTERVAL_S = 5.0
#: How often this node's IMEX daemon is checked: one that died while claims hold its domain's
#: channel is restarted within this long.
IMEX_SUPERVISE_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Node:
    """Every service of one agent; none is ever missing."""

    settings: Settings
    backend: Backend
    session: NvmlSession
    inventory: GpuInventory
    events: EventLog
    metrics: AgentMetrics
    readiness: Readiness
    ledger: NodeLedger
    mig: MigService
    claims: ClaimService
    health: GpuHealth
    collector: Collector
    topology: TopologyService
    resource_slices: ResourceSliceService
    xids: XidWatcher
    #: Claims, shares and MPS daemons as metrics (agent/claims/signals.py).
    signals: ClaimSampler
    #: This node's compute domain and its IMEX daemon (agent/domains/).
    domains: DomainService
    #: Pod attribution from kubelet (--pod-resources-socket), else None.
    pods: PodResourcesPoller | None = None
    #: Set once start-up (recovery) has finished and the background work runs.
    started: asyncio.Event = field(default_factory=asyncio.Event)
    #: The background work :meth:`running` started after start-up.
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, repr=False)
    #: The taints last published (events and the gauge follow their changes).
    _taints: dict[TaintId, PlacedTaint] = field(default_factory=dict, repr=False)

    @property
    def sim(self) -> SimulatedNode | None:
        """The simulated node's controls, with ``--simulate``."""
        return self.backend.sim

    @contextlib.asynccontextmanager
    async def running(self, *, wait: bool = True, retry: bool = False) -> AsyncIterator[Node]:
        """The node's one lifecycle. Start-up (:meth:`start`; with ``retry``, retried with
        backoff while NVML or the state directory is not there yet, the node staying up and
        unready meanwhile) and then every background task run in one TaskGroup; the block
        runs beside them (``wait``: only once start-up has finished, so a caller gets a
        ready node). However the block ends, every task is cancelled and everything started
        is stopped in reverse, events last. A failure of start-up or of a background task
        ends the block with that exception."""
        try:
            async with asyncio.TaskGroup() as group:
                work = group.create_task(self._start_then_run(group, retry=retry))
                try:
                    if wait:
                        started = asyncio.ensure_future(self.started.wait())
                        await asyncio.wait({work, started}, return_when=asyncio.FIRST_COMPLETED)
                        started.cancel()
                        if work.done():
                            work.result()  # start-up failed: its error, plainly
                    yield self
                finally:
                    for task in (work, *self._tasks):
                        task.cancel()
        except BaseExceptionGroup as failed:
            first = failed.exceptions[0]
            raise first from first.__cause__
        finally:
            await self._stop()

    async def _start_then_run(self, group: asyncio.TaskGroup, *, retry: bool) -> None:
        await (self._start_retrying() if retry else self.start())
        background = [self._publish_availability(), self._watch_drift(),
                      self.claims.node_spec.run(),
                      self.claims.supervise_daemons(MPS_SUPERVISE_INTERVAL_S),
                      self.domains.supervise(IMEX_SUPERVISE_INTERVAL_S),
                      self.signals.run(self.settings.collect_interval_s)]
        if self.pods is not None:
            background.append(self.pods.run())
        for work in background:
            self._tasks.append(group.create_task(work))
        self.started.set()

    async def start(self) -> None:
        """Bring the node up: NVML, inventory, topology, then recovery in the order that keeps
        held devices safe (claims' holds loaded, journal resolved, claims reconciled, desired
        geometry re-applied), then metrics and XIDs. Until recovery ends, ``readiness`` is
        not reconciled, and the API serves no mutation. NVML errors propagate (``running``
        retries them with ``retry``); a corrupt checkpoint leaves the node reconciled but
        unready. Call it through :meth:`running`, which also stops what it started."""
        self.readiness.set("initialising NVML")
        await self.session.initialise()
        self.readiness.set("loading inventory")
        await self.inventory.load()
        # Health first: a GPU lost before this start is known again with its fault's time.
        self.health.track(gpu.static for gpu in self.inventory.gpus)
        await self.ledger.register(self.inventory.gpus)
        self.readiness.set("discovering topology")
        await self.topology.load()
        self.readiness.set("loading prepared claims")
        await self.claims.load()
        self.readiness.set("resolving open MIG transitions")
        await self.mig.recover()
        self.readiness.set("reconciling claims and CDI specs")
        await self.claims.reconcile()
        self.readiness.set("recovering the compute domain's IMEX daemon")
        await self.domains.recover()
        self.readiness.set("reconciling MIG geometry")
        await self.mig.reconcile()
        # Metrics and XID health work even where claims cannot (below): they need NVML only.
        self.readiness.set("collecting metrics")
        if self.pods is not None:
            # One answer before the first round, so the first scrape already has pod labels
            # (a kubelet that does not answer costs at most one bounded call).
            await self.pods.poll()
        await self.collector.start()
        self.xids.start(gpu.static for gpu in self.inventory.gpus)
        self.publish_availability()
        # From here on mutations are served: in the same step as /readyz turns ready, so
        # nothing is acknowledged while the agent still reports itself not ready.
        self.readiness.reconciled = True
        self.readiness.storage_blocked = None
        if self.claims.corrupt is not None:
            # Reported here and in /readyz; claims answer 503 until an operator acts.
            self.readiness.set(f"{self.claims.corrupt}; an operator must act before claims "
                               "work")
            return
        self.readiness.set(None)
        self.metrics.ready.set(1)
        self.events.append("agent.ready", f"agent ready with {len(self.inventory.gpus)} GPUs",
                           details={"backend": self.backend.name})

    async def _start_retrying(self) -> None:
        """:meth:`start`, retried with backoff while the driver or the state directory is not
        there yet; the agent stays up (and unready) meanwhile instead of crash-looping."""

        def before_sleep(state: RetryCallState) -> None:
            err = state.outcome.exception() if state.outcome else None
            what = ("recovery needs a write it cannot make"
                    if isinstance(err, StorageUnavailable) else "NVML not available")
            said = err.detail if isinstance(err, AgentError) else err
            reason = f"{what}: {said} (attempt {state.attempt_number}, retrying)"
            self.readiness.storage_blocked = (err.errno or 0, err.path) \
                if isinstance(err, StorageUnavailable) else None
            self.readiness.set(reason)
            log.warning(what.lower(), extra={"attempt": state.attempt_number,
                                             "error": str(err)})

        # A full state directory is retried like a missing driver: the agent stays up,
        # serving what needs no reconciliation, and /readyz says which write recovery waits
        # for.
        retry = retry_if_exception_type((NvmlError, StorageUnavailable))
        async for attempt in AsyncRetrying(retry=retry,
                                           wait=wait_exponential_jitter(multiplier=0.5, max=30),
                                           before_sleep=before_sleep, reraise=True):
            with attempt:
                await self.start()

    def publish_availability(self) -> None:
        """``gpu_agent_gpu_available`` from the ledger's one availability model, and its
        taints: the gauge of each, and an event when one is added or goes."""
        for gpu in self.inventory.gpus:
            self.metrics.gpu_available.labels(str(gpu.index), gpu.uuid).set(
                0 if self.ledger.condition(gpu) else 1)
        now = node_taints((((self.health.identity(g.uuid) or (g.uuid, 0))[0], g.index,
                            self.ledger.faults(g)) for g in self.inventory.gpus),
                          driver=self.ledger.driver, no_execute=self.ledger.no_execute)
        added, removed = changes(self._taints, now)
        self._taints.clear()
        self._taints.update(now)
        gauge = self.metrics.gpu_taint_added
        for placed, verb in [*((p, "removed") for p in removed), *((p, "added") for p in added)]:
            t = placed.taint
            labels = (str(placed.index), placed.gpu,
                      "" if placed.gpu_instance is None else str(placed.gpu_instance),
                      t.key, t.value or "", t.effect)
            if verb == "added":
                gauge.labels(*labels).set(t.time_added)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
            where = "" if placed.gpu_instance is None else f" GPU instance {placed.gpu_instance}"
            value = "" if t.value is None else f"={t.value}"
            self.events.append(
                f"gpu.taint_{verb}", f"GPU {placed.index}{where} ({placed.gpu}): taint "
                f"{t.key}{value}:{t.effect} {verb}: {t.reason}",
                severity=Severity.WARNING if verb == "added" and t.blocking else Severity.INFO,
                gpu=placed.gpu, details={"key": t.key, "value": t.value, "effect": t.effect,
                                         "time_added": t.time_added, "reason": t.reason,
                                         "gpu_instance_id": placed.gpu_instance})

    async def _publish_availability(self) -> None:
        """Keep the gauge as fresh as the DCGM series (one collection interval), off the
        scrape path: a scrape serves what is there."""
        while True:
            await asyncio.sleep(self.settings.collect_interval_s)
            self.publish_availability()

    async def _watch_drift(self) -> None:
        """Report MIG geometries changed behind the agent's back (nvidia-smi, mig-parted)."""
        while True:
            await asyncio.sleep(self.settings.drift_check_interval_s)
            try:
                await self.inventory.refresh()
                await self.mig.check_drift()
            except AgentError as err:
                log.warning("drift check failed", extra={"error": err.detail})

    async def _stop(self) -> None:
        """Everything :meth:`start` started, in reverse (transitions in flight are abandoned;
        the journal resolves them at the next start); the event history written last."""
        self._tasks.clear()
        await self.mig.close()
        await self.claims.checkpoint.idle()
        await asyncio.to_thread(self.xids.stop)  # up to one wait slice: off the event loop
        self.collector.stop()
        await asyncio.to_thread(self.health.close)  # the health state's last write
        if self.pods is not None:
            await self.pods.close()
        self.session.close()
        self.events.append("agent.stopped", "agent stopped", severity=Severity.INFO)
        await asyncio.to_thread(self.events.close)  # the history's last write


def _after_reset(session: NvmlSession, health: GpuHealth, uuid: str) -> None:
    """A GPU reset by --gpu-reset-command answers afresh: its lost and XID marks go."""
    session.clear_lost(uuid)
    health.clear(uuid, why="reset by --gpu-reset-command")


def build_node(settings: Settings, backend: Backend, *,
               sharing: SharingRuntime | None = None) -> Node:
    """The agent's services for ``settings`` over ``backend``, wired once; ``sharing``
    replaces the sharing tools built from settings (tests)."""
    metrics = AgentMetrics()
    metrics.set_build(version=agent.__version__, backend=backend.name)
    session = NvmlSession(backend.nvml, on_error=metrics.count_nvml_error)
    inventory = GpuInventory(session)
    events = EventLog(history=settings.state_dir / "events.json")
    state = settings.state_dir
    xids: XidWatcher | None = None

    def monitored() -> tuple[str, ...] | None:
        """The GPUs whose XIDs are watched; None until registration ended."""
        if xids is None or not xids.registration_done.is_set():
            return None
        return xids.registered

    health = GpuHealth(events=events, metrics=metrics, lost_reason=session.lost_reason,
                       state_path=state / "health" / "faults.json",
                       boot_id=boot_id(settings.proc_root), monitored=monitored)
    ledger = NodeLedger(quarantine_path=state / "mig" / "quarantine.json", events=events,
                        faults=health.faults, lost_reason=session.lost_reason,
                        drain_path=state / "health" / "drain.json",
                        driver=settings.driver_name, no_execute=settings.no_execute_taints)
    devices = MigDevices(session=session, ledger=ledger,
                         journal=TransitionJournal(state / "mig" / "journal"), events=events,
                         metrics=metrics, reset_command=settings.gpu_reset_command,
                         on_reset=lambda uuid: _after_reset(session, health, uuid))
    mig = MigService(devices=devices, inventory=inventory, events=events, metrics=metrics,
                     ledger=ledger, state_dir=state, proc_root=settings.proc_root,
                     reapply=settings.reapply_mig)
    tools = _tools_dir(settings, backend)
    domains = DomainService(
        settings=ImexSettings(address=settings.imex_address, port=settings.imex_port,
                              ready_timeout_s=settings.imex_ready_timeout_s),
        directory=state / "imex",
        control=ImexControl(settings.imex or tools / "nvidia-imex",
                            settings.imex_ctl or tools / "nvidia-imex-ctl",
                            # Through the MPS host: the daemon outlives the agent's cgroup.
                            HostLauncher(settings.mps_host_socket)
                            if settings.mps_host_socket is not None else DirectLauncher()),
        ledger=ledger, events=events, metrics=metrics)
    claims = ClaimService(
        inventory=inventory, ledger=ledger, devices=devices, events=events,
        checkpoint=ClaimCheckpoint(state / "claims.checkpoint", boot_id(settings.proc_root),
                                   on_write=metrics.claims_checkpoint_writes.inc),
        cdi=CdiWriter(settings.cdi_dir, settings.proc_root, settings.driver_root,
                      owner=agent_id(settings.state_dir),
                      dev_root=settings.dev_root or backend.dev_root
                      or (backend.sim.dev_root if backend.sim is not None else None)),
        tombstone_s=settings.claim_tombstone_s, run_dir=settings.run_dir,
        device_node_wait_s=settings.device_node_wait_s,
        sharing=sharing or _sharing(settings, backend, session),
        dynamic_mig=settings.dynamic_mig, channels=domains)
    topology = TopologyService(session=session, inventory=inventory, sys_root=backend.sys_root,
                               ledger=ledger)
    resource_slices = ResourceSliceService(inventory=inventory, topology=topology, ledger=ledger,
                          state_dir=state, node_name=settings.node_name,
                          driver=settings.driver_name, dynamic_mig=settings.dynamic_mig,
                          gpu_shares=settings.gpu_shares, identity=health.identity)
    pods = _pod_resources(settings, inventory, metrics)
    signals = ClaimSampler(claims=claims, ledger=ledger, inventory=inventory,
                           metrics=ClaimMetrics(metrics.registry), gpu_shares=settings.gpu_shares)
    collector = Collector(session=session, inventory=inventory, metrics=metrics, health=health,
                          interval_s=settings.collect_interval_s, hostname=settings.node_name,
                          hostname_label=settings.metrics_hostname_label,
                          attribution=lambda: claim_attribution(claims.records()),
                          holders=pods.holders if pods is not None else None,
                          shares=lambda: share_attribution(claims.records(),
                                                           signals.share_used))
    xids = XidWatcher(session, collector.on_xid, on_error=metrics.count_nvml_error)
    return Node(settings=settings, backend=backend, session=session, inventory=inventory,
                events=events, metrics=metrics, readiness=Readiness(), ledger=ledger,
                mig=mig, claims=claims, health=health, collector=collector,
                topology=topology, resource_slices=resource_slices, xids=xids,
                signals=signals, pods=pods, domains=domains)


def _tools_dir(settings: Settings, backend: Backend) -> Path:
    """Where the driver's tools are when no flag names one: the simulator's with
    ``--simulate``, else ``<driver root or />/usr/bin``."""
    return backend.sim.tools_dir if backend.sim is not None else \
        (settings.driver_root or Path("/")) / "usr" / "bin"


def _sharing(settings: Settings, backend: Backend, session: NvmlSession) -> SharingRuntime:
    """The sharing tools from settings: ``nvidia-smi`` and ``nvidia-cuda-mps-control`` where
    configured, else under ``<driver root or />/usr/bin`` (the simulator's tools with
    ``--simulate``); daemons started by the MPS host (``--mps-host-socket``) when set, else by
    the agent itself."""
    default_dir = _tools_dir(settings, backend)
    launcher: MpsLauncher = HostLauncher(settings.mps_host_socket) \
        if settings.mps_host_socket is not None else DirectLauncher()
    assert settings.mps_root is not None, "resolved settings always have one"

    async def usage(device: str) -> dict[int, int]:
        found = await session.read(partial(mps_processes, session, device))
        return {p.pid: p.used_mib for p in found}

    return SharingRuntime(
        nvidia_smi=NvidiaSmi(settings.nvidia_smi or default_dir / "nvidia-smi"),
        mps=MpsControl(settings.mps_control or default_dir / "nvidia-cuda-mps-control",
                       launcher),
        mps_root=settings.mps_root, usage=usage)


def _pod_resources(settings: Settings, inventory: GpuInventory,
                   metrics: AgentMetrics) -> PodResourcesPoller | None:
    """The kubelet PodResources poller with --pod-resources-socket, else None. The gRPC client
    is imported only then: grpcio is the optional ``kubernetes`` extra (settings refuse the
    flag without it)."""
    if settings.pod_resources_socket is None:
        return None
    from agent.podresources.client import PodResourcesClient  # noqa: PLC0415 - optional grpcio

    interval = settings.collect_interval_s
    client = PodResourcesClient(settings.pod_resources_socket, timeout_s=POD_RESOURCES_TIMEOUT_S)
    return PodResourcesPoller(fetch=client.list, close=client.close,
                              gpus=lambda: inventory.gpus, driver=settings.driver_name,
                              interval_s=interval, timeout_s=POD_RESOURCES_TIMEOUT_S,
                              on_error=metrics.podresources_errors.inc,
                              on_success=metrics.podresources_last_success.set)

