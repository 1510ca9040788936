"""``gpu-agent serve``: one agent per state directory, from start-up to a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
from pathlib import Path

from aiohttp import web
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_exponential_jitter

import agent
from agent.api.access import TokenReloader, set_socket_owner, ssl_context
from agent.api.app import build_app
from agent.api.auth import TokenStore, generate_token_file
from agent.api.connections import IDLE_TIMEOUT_S, ConnectionLimits, GuardedSite
from agent.api.context import AgentContext
from agent.claims.cdi_writer import CdiDirectoryLock, CdiWriter, agent_id
from agent.claims.checkpoint import ClaimCheckpoint
from agent.claims.service import ClaimService
from agent.dra.service import SliceService
from agent.durable import ExclusiveLock, write_atomic
from agent.errors import AgentError, NvmlError
from agent.events import EventLog, Severity
from agent.gpu import backend as gpu_backend
from agent.gpu.backend import Backend
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.xid import XidWatcher
from agent.host import boot_id
from agent.metrics.agent import AgentMetrics
from agent.metrics.collector import Collector, claim_attribution
from agent.metrics.health import GpuHealth
from agent.metrics.server import build_metrics_app
from agent.mig.service import MigService
from agent.settings import Listener, Settings
from agent.systemd import Notifier
from agent.topology.service import HeldByClaims, TopologyService

log = logging.getLogger("agent.daemon")


def open_backend(settings: Settings) -> Backend:
    """The NVML implementation the settings ask for."""
    return gpu_backend.open_backend(simulate=settings.simulate, state_dir=settings.state_dir,
                                    proc_root=settings.proc_root)


def load_tokens(settings: Settings) -> TokenStore:
    """The configured tokens; a simulated agent without a token file gets a generated one."""
    if settings.token_file is not None:
        return TokenStore.load(settings.token_file)
    if settings.simulate:
        path = settings.state_dir / "tokens"
        if not path.exists():
            generate_token_file(path)
        store = TokenStore.load(path)
        token = path.read_text().split(":")[1].strip()
        # Printed once for the developer at the terminal; the structured log never carries it.
        print(f"simulated agent token (also in {path}): {token}", flush=True)
        return store
    return TokenStore.empty()


def _unlink_stale_socket(path: Path) -> None:
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody answers: left behind by a killed agent
        return
    finally:
        probe.close()
    raise AgentError(f"{path} is served by another running process; choose another --listen")


async def _start_sites(runner: web.AppRunner, listeners: tuple[Listener, ...], *,
                      cap: int, limits: ConnectionLimits, tls: ssl.SSLContext | None = None,
                      socket_group: str | None = None) -> list[str]:
    """Bind every listener, each holding at most ``cap`` connections: Unix sockets mode 0660
    (group ``socket_group``), TCP listeners over TLS when ``tls`` is given."""
    bound: list[str] = []
    for listener in listeners:
        if listener.path is not None:
            listener.path.parent.mkdir(parents=True, exist_ok=True)
            _unlink_stale_socket(listener.path)
        site = GuardedSite(runner, listener, cap=cap, limits=limits,
                           ssl_context=tls if listener.path is None else None)
        await site.start()
        if listener.path is not None:
            set_socket_owner(listener.path, socket_group)
        bound += site.addresses()  # the bound port is only known here when port 0 was asked
    return bound


async def _become_ready(ctx: AgentContext, xids: XidWatcher) -> None:
    """Initialise NVML and load the inventory, retrying with backoff while the driver is not
    there yet; the agent stays up (and unready) meanwhile instead of crash-looping."""

    def before_sleep(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        reason = f"NVML not available: {err} (attempt {state.attempt_number}, retrying)"
        ctx.readiness.set(reason)
        log.warning("nvml not available", extra={"attempt": state.attempt_number,
                                                  "error": str(err)})

    ctx.readiness.set("initialising NVML")
    assert ctx.mig is not None and ctx.claims is not None
    async for attempt in AsyncRetrying(retry=retry_if_exception_type(NvmlError),
                                       wait=wait_exponential_jitter(multiplier=0.5, max=30),
                                       before_sleep=before_sleep, reraise=True):
        with attempt:
            await ctx.session.initialise()
            ctx.readiness.set("loading inventory")
            await ctx.inventory.load()
            if ctx.topology is not None:
                ctx.readiness.set("discovering topology")
                await ctx.topology.load()
            ctx.readiness.set("resolving open MIG transitions")
            await ctx.mig.recover()
            ctx.readiness.set("reconciling claims and CDI specs")
            await ctx.claims.reconcile()
            ctx.readiness.set("reconciling MIG geometry")
            await ctx.mig.reconcile()
    # Metrics and XID health work even where claims cannot (below): they need NVML only.
    if ctx.collector is not None:
        ctx.readiness.set("collecting metrics")
        await ctx.collector.start()
    xids.start(gpu.static for gpu in ctx.inventory.gpus)
    if ctx.claims.corrupt is not None:
        # Reported here and in /readyz; the GPU and MIG endpoints keep serving, claims do not.
        ctx.readiness.set(f"{ctx.claims.corrupt}; an operator must act before claims work")
        return
    ctx.readiness.set(None)
    ctx.metrics.ready.set(1)
    ctx.events.append("agent.ready", f"agent ready with {len(ctx.inventory.gpus)} GPUs",
                      details={"backend": ctx.backend})


async def _watch_drift(ctx: AgentContext) -> None:
    """Report MIG geometries changed behind the agent's back (nvidia-smi, mig-parted)."""
    assert ctx.mig is not None
    while True:
        await asyncio.sleep(ctx.settings.drift_check_interval_s)
        try:
            await ctx.inventory.refresh()
            await ctx.mig.check_drift()
        except AgentError as err:
            log.warning("drift check failed", extra={"error": err.detail})


async def serve(settings: Settings) -> int:
    """Run the agent until SIGTERM/SIGINT; return the process exit code."""
    lock = ExclusiveLock(settings.state_dir / "agent.lock")
    lock.acquire()
    cdi_lock = CdiDirectoryLock(settings.cdi_dir, settings.state_dir)
    backend: Backend | None = None
    try:
        cdi_lock.acquire()
        backend = open_backend(settings)
        return await _run(settings, backend)
    finally:
        if backend is not None and backend.sim is not None:
            backend.sim.close()
        cdi_lock.release()
        lock.release()


async def _run(settings: Settings, backend: Backend) -> int:
    metrics = AgentMetrics()
    metrics.set_build(version=agent.__version__, backend=backend.name)
    session = NvmlSession(backend.nvml, on_error=metrics.count_nvml_error)
    inventory = GpuInventory(session)
    events = EventLog()
    service = MigService(session=session, inventory=inventory, events=events, metrics=metrics,
                         state_dir=settings.state_dir, proc_root=settings.proc_root,
                         reset_command=settings.gpu_reset_command, reapply=settings.reapply_mig)
    claims = ClaimService(
        session=session, inventory=inventory, mig_service=service, events=events,
        checkpoint=ClaimCheckpoint(settings.state_dir / "claims.checkpoint",
                                   boot_id(settings.proc_root),
                                   on_write=metrics.claims_checkpoint_writes.inc),
        cdi=CdiWriter(settings.cdi_dir, settings.proc_root, settings.driver_root,
                      owner=agent_id(settings.state_dir)),
        tombstone_s=settings.claim_tombstone_s)
    health = GpuHealth(events=events, metrics=metrics, lost_reason=session.lost_reason)
    topology = TopologyService(session=session, inventory=inventory, sys_root=backend.sys_root,
                               held=HeldByClaims(claims), quarantine=service)
    slices = SliceService(inventory=inventory, topology=topology, state_dir=settings.state_dir,
                          node_name=settings.node_name, driver=settings.driver_name,
                          dynamic_mig=settings.dynamic_mig, mig=service)
    collector = Collector(session=session, inventory=inventory, metrics=metrics, health=health,
                          interval_s=settings.collect_interval_s, hostname=settings.node_name,
                          hostname_label=settings.metrics_hostname_label,
                          attribution=lambda: claim_attribution(claims.claims()))
    xids = XidWatcher(session, collector.on_xid, on_error=metrics.count_nvml_error)
    ctx = AgentContext(settings=settings, session=session, inventory=inventory,
                       events=events, tokens=load_tokens(settings), metrics=metrics,
                       backend=backend.name, mig=service, claims=claims, sim=backend.sim,
                       collector=collector, health=health, topology=topology, slices=slices)
    limits = ConnectionLimits.for_process(len(settings.listen),
                                          metrics=settings.metrics_listen is not None)
    runner = web.AppRunner(build_app(ctx), handle_signals=False, access_log=None,
                           shutdown_timeout=settings.shutdown_timeout_s,
                           keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    metrics_runner: web.AppRunner | None = None
    if settings.metrics_listen is not None:
        metrics_runner = web.AppRunner(build_metrics_app(ctx), handle_signals=False,
                                       access_log=None, shutdown_timeout=2,
                                       keepalive_timeout=IDLE_TIMEOUT_S)
        await metrics_runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader: TokenReloader | None = None
    if ctx.tokens.source is not None:
        reloader = TokenReloader(ctx, ctx.tokens.source)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        reloader.start()
    startup: asyncio.Task[None] | None = None
    drift: asyncio.Task[None] | None = None
    notifier = Notifier.attach(ctx)  # None unless systemd started us with Type=notify
    try:
        bound = await _start_sites(runner, settings.listen, tls=ssl_context(settings),
                                   socket_group=settings.socket_group, cap=limits.api_cap,
                                   limits=limits)
        metrics_bound = (await _start_sites(metrics_runner, (settings.metrics_listen,),
                                            cap=limits.metrics_cap, limits=limits)
                         if metrics_runner is not None and settings.metrics_listen else [])
        write_atomic(settings.state_dir / "listeners.json",
                     json.dumps({"pid": os.getpid(), "listeners": bound,
                                 "metrics": metrics_bound}).encode())
        log.info("listening", extra={"listeners": ",".join(bound), "backend": backend.name,
                                     "state_dir": str(settings.state_dir),
                                     "version": agent.__version__})
        startup = asyncio.create_task(_become_ready(ctx, xids))
        if notifier is not None:
            notifier.start()
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({startup, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if startup.done() and startup.exception() is not None:
            raise startup.exception()  # type: ignore[misc]
        if startup.done():
            drift = asyncio.create_task(_watch_drift(ctx))
            if notifier is not None:
                notifier.startup_finished()
        await stopped
        log.info("stopping", extra={"reason": "signal"})
        if notifier is not None:
            notifier.stopping()
        ctx.readiness.set("shutting down")
        ctx.metrics.ready.set(0)
        return 0
    finally:
        if notifier is not None:
            await notifier.close()
        for task in (startup, drift):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if reloader is not None:
            await reloader.stop()
        await service.close()
        # Stops accepting, lets in-flight requests finish (up to shutdown_timeout), closes.
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        xids.stop()
        collector.stop()
        session.close()
        ctx.events.append("agent.stopped", "agent stopped", severity=Severity.INFO)
        with contextlib.suppress(FileNotFoundError):
            (settings.state_dir / "listeners.json").unlink()
