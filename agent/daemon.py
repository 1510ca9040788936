"""``gpu-agent serve``: one agent per state directory, from start-up to a graceful stop."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

from aiohttp import web

import agent
from agent.api.access import TokenReloader, set_socket_owner, ssl_context
from agent.api.app import build_app
from agent.api.auth import TokenStore, generate_token_file
from agent.api.connections import IDLE_TIMEOUT_S, ConnectionLimits, GuardedSite, ListenerCaps
from agent.api.context import AgentContext
from agent.api.metrics_app import build_metrics_app
from agent.claims.cdi_writer import CdiDirectoryLock
from agent.durable import ExclusiveLock, write_atomic
from agent.errors import AgentError, StorageUnavailable
from agent.gpu import backend as gpu_backend
from agent.gpu.backend import Backend
from agent.settings import Listener, Settings
from agent.systemd import Notifier
from agent.wiring import Node, build_node

log = logging.getLogger("agent.daemon")


def open_backend(settings: Settings) -> Backend:
    """The NVML implementation the settings ask for."""
    return gpu_backend.open_backend(simulate=settings.simulate, state_dir=settings.state_dir,
                                    proc_root=settings.proc_root,
                                    sim_cluster_uuid=settings.sim_cluster_uuid,
                                    sim_clique_id=settings.sim_clique_id)


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
        # Printed once for the developer at the terminal, on stderr so that stdout stays the
        # program's output; the structured log never carries it.
        print(f"simulated agent token (also in {path}): {token}", file=sys.stderr, flush=True)
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
                      caps: ListenerCaps, limits: ConnectionLimits,
                      tls: ssl.SSLContext | None = None,
                      socket_group: str | None = None) -> list[str]:
    """Bind every listener, each holding connections as ``caps`` say: Unix sockets mode 0660
    (group ``socket_group``), TCP listeners over TLS when ``tls`` is given."""
    bound: list[str] = []
    for listener in listeners:
        if listener.path is not None:
            listener.path.parent.mkdir(parents=True, exist_ok=True)
            _unlink_stale_socket(listener.path)
        site = GuardedSite(runner, listener, caps=caps, limits=limits,
                           ssl_context=tls if listener.path is None else None)
        try:
            await site.start()
        except OSError as err:  # one line for the operator, not a traceback
            held = " (another process holds it: another agent?)" \
                if err.errno == errno.EADDRINUSE else ""
            raise AgentError(f"cannot listen on {listener}: {err.strerror or err}{held}; "
                             "choose another --listen or --metrics-listen") from err
        if listener.path is not None:
            set_socket_owner(listener.path, socket_group)
        bound += site.addresses()  # the bound port is only known here when port 0 was asked
    return bound


async def _write_listeners(path: Path, doc: dict[str, object]) -> None:
    """Best effort (a full state directory must not stop the agent from serving reads): the
    file only tells tools where the agent listens. In a thread: it fsyncs."""
    try:
        await asyncio.to_thread(write_atomic, path, json.dumps(doc).encode())
    except StorageUnavailable as err:
        log.warning("listeners.json not written; serving anyway", extra={"error": err.detail})


def _remove_listeners(path: Path) -> None:
    """At stop; a state directory that no longer takes writes (remounted read-only) leaves
    the file behind with a warning, not a traceback: the stop is still clean, and the next
    start rewrites it."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("listeners.json not removed; it names a stopped agent until the next start",
                    extra={"path": str(path), "error": err.strerror or str(err)})


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
    node = build_node(settings, backend)
    # Start-up runs beside the listeners (they answer 503 until it is done), retried while
    # the driver or the state directory is not there yet.
    async with node.running(wait=False, retry=True):
        return await _serve(node)


async def _serve(node: Node) -> int:
    settings = node.settings
    ctx = AgentContext(node=node, tokens=load_tokens(settings))
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
    notifier = Notifier.attach(node)  # None unless systemd started us with Type=notify
    stopped = asyncio.ensure_future(stop.wait())
    started = asyncio.ensure_future(node.started.wait())
    try:
        bound = await _start_sites(runner, settings.listen, tls=ssl_context(settings),
                                   socket_group=settings.socket_group, caps=limits.api,
                                   limits=limits)
        metrics_bound = (await _start_sites(metrics_runner, (settings.metrics_listen,),
                                            caps=limits.metrics, limits=limits)
                         if metrics_runner is not None and settings.metrics_listen else [])
        await _write_listeners(settings.state_dir / "listeners.json",
                               {"pid": os.getpid(), "listeners": bound, "metrics": metrics_bound})
        log.info("listening", extra={"listeners": ",".join(bound),
                                     "metrics": ",".join(metrics_bound) or "-",
                                     "backend": node.backend.name,
                                     "state_dir": str(settings.state_dir),
                                     "version": agent.__version__})
        if notifier is not None:
            notifier.start()
        await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if started.done() and notifier is not None:
            notifier.startup_finished()
        await stopped
        log.info("stopping", extra={"reason": "signal"})
        if notifier is not None:
            notifier.stopping()
        node.readiness.set("shutting down")
        node.metrics.ready.set(0)
        return 0
    finally:
        for waiter in (started, stopped):
            waiter.cancel()
        if notifier is not None:
            await notifier.close()
        if reloader is not None:
            await reloader.stop()
        # Stops accepting, lets in-flight requests finish (up to shutdown_timeout), closes.
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        _remove_listeners(settings.state_dir / "listeners.json")
