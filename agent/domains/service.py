"""This node's side of a compute domain: the IMEX node list it was given, its IMEX daemon, and
the channel its claims hold.

- One domain at a time, durable (``<state>/imex/domain.json``: id, peers, the daemon's pid).
  Unreadable domain state is kept aside and fails closed: every domain call and channel
  prepare is refused, saying so, until an operator removes the domain (``DELETE`` is refused
  too: what ran is unknown) by moving the kept-aside file away and restarting, or by
  ``POST /v1/admin/domain-state`` (accept empty state).
- A channel is a device in the one-owner ledger (key :data:`CHANNEL_KEY`): each claim of
  the domain holds a share of channel 0 (NVIDIA's ``Single`` mode), so the ledger's holders
  of that key are the daemon's holders; the claims checkpoint records them.
- The daemon runs as the MPS daemons do: it outlives the agent (``DAEMONIZE=1``, a session
  of its own), is re-adopted at start-up (the recorded pid still runs ``nvidia-imex -c
  <our config>``), restarted when it died while holders exist (at start-up and by
  :meth:`DomainService.supervise`), and stopped when the last holder goes.
- Seats, not addresses, make the node list: ``nodes_config.cfg`` holds one fixed name per
  seat and the daemon's own ``/etc/hosts`` (``<state>/imex/hosts``, bind-mounted in its
  mount namespace) maps each held seat to its member's address. A seat that moves to
  another address (same size) rewrites the hosts file in place and sends the daemon
  SIGUSR1, which IMEX processes at most once per 5 s: a change inside that window is sent
  once it has passed (:func:`next_signal`). A new size restarts the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

from agent.domains.config import (
    ImexFiles,
    imex_files,
    peer_errors,
    render_config,
    render_hosts,
    render_nodes,
    seat_names,
)
from agent.durable import DurableMap, write_atomic
from agent.errors import (
    AgentError,
    Conflict,
    DomainBusy,
    DomainUnknown,
    ImexNotConfigured,
    ImexUnavailable,
    InvalidRequest,
    NotFound,
    StateUnreadable,
)
from agent.events import EventLog, Severity
from agent.gpu.imex import ImexDomainView
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import Hold, HoldState, NodeLedger, Share
from agent.metrics.agent import AgentMetrics

log = logging.getLogger("agent.domains")

#: The ledger key of IMEX channel 0 (not a GPU: its own entry in the ledger).
CHANNEL = 0
CHANNEL_KEY = DeviceKey(f"imex-channel-{CHANNEL}")
CHANNEL_NAME = f"imex-channel-{CHANNEL}"
#: Every claim of the domain takes one of these; the channel is shared by all of them.
_SHARE = "imex_claims"
_UNBOUNDED = {_SHARE: 2**62}
_POLL_S = 0.1
DaemonState = Literal["running", "stopped", "failed"]
#: IMEX processes SIGUSR1 at most once per 5 s (its guide); a margin over that, so a signal
#: sent just after the window never lands inside it.
RECONNECT_WINDOW_S = 5.5


def next_signal(last: float | None, now: float, *, pending: bool,
                window_s: float = RECONNECT_WINDOW_S) -> float | None:
    """When the daemon should get its next SIGUSR1 (pure, monotonic seconds): None with
    nothing pending; at once (``now``) when no signal went to this daemon (``last`` None) or
    the last one is a window old; else once the window after it has passed. An adopted
    daemon's last signal is unknown: the caller passes the adoption time (possibly
    recent)."""
    if not pending:
        return None
    if last is None:
        return now
    return max(now, last + window_s)


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Replace a file's content keeping its inode (write, truncate, fsync): the daemon's
    bind mount of it pins the inode, so a rename would leave the daemon the old file."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


class ImexTools(Protocol):
    """This node's IMEX binaries (:class:`agent.gpu.imex.ImexControl` on a node)."""

    async def start(self, config: Path, hosts: Path) -> None:
        """Start a daemon with ``config`` and ``hosts`` as its ``/etc/hosts``;
        :class:`ImexUnavailable` with why not."""
        ...

    def reconnect(self, pid: int, config: Path) -> bool:
        """SIGUSR1 to the daemon ``pid`` if it still runs with ``config``; whether sent."""
        ...

    async def state(self, config: Path) -> str | None:
        """What ``-q`` answers, or None when no daemon does."""
        ...

    async def domain(self, config: Path) -> ImexDomainView | None:
        """The domain as the daemon sees it (``-N -j``), or None."""
        ...

    def find(self, config: Path) -> int | None:
        """The pid of a daemon running with ``config``."""
        ...

    def runs(self, pid: int, config: Path) -> bool:
        """Whether ``pid`` is a daemon running with ``config``."""
        ...

    async def stop(self, pid: int, config: Path, *, timeout_s: float = 10.0) -> None:
        """SIGTERM, a bounded wait, SIGKILL."""
        ...


@dataclass(frozen=True)
class Domain:
    """The domain this node is a member of: each seat's member address (None: an empty
    seat), the daemon's pid, and whether its hosts file changed since it was last told to
    reconnect."""

    id: str
    peers: tuple[str | None, ...]
    pid: int | None = None
    reconnect: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The IMEX node name of each seat."""
        return seat_names(self.id, len(self.peers))


@dataclass(frozen=True)
class DaemonView:
    state: DaemonState
    pid: int | None
    imex_state: str | None
    reason: str | None


@dataclass(frozen=True)
class _Seen:
    """One reading of a daemon: its pid, ``-q``'s state and ``-N -j``'s domain."""

    pid: int
    imex_state: str | None
    imex: ImexDomainView | None


@dataclass(frozen=True)
class DomainView:
    """What ``GET /v1/domains`` shows of a domain."""

    domain: Domain
    address: str
    daemon: DaemonView
    imex: ImexDomainView | None
    holders: tuple[str, ...]


@dataclass(frozen=True)
class ImexSettings:
    """``--imex-address`` (None: not configured), ``--imex-port``,
    ``--imex-ready-timeout-s``."""

    address: str | None
    port: int = 50000
    ready_timeout_s: float = 30.0


class DomainService:
    def __init__(self, *, settings: ImexSettings, directory: Path, control: ImexTools,
                 ledger: NodeLedger, events: EventLog, metrics: AgentMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        #: Monotonic seconds, for the SIGUSR1 window (a test's own clock).
        self._clock = clock
        self.files: ImexFiles = imex_files(directory)
        self._control = control
        self._ledger = ledger
        self._events = events
        self._metrics = metrics
        self._state = DurableMap(directory / "domain.json", format="gpu-agent-imex-domain")
        self._lock = asyncio.Lock()
        self._recovered = False
        #: Why the daemon is failed (its last start or restart), or None.
        self._failure: str | None = None
        #: What the daemon answered last (supervision reads it every round; a request is
        #: served from it rather than running nvidia-imex-ctl twice per GET).
        self._seen: _Seen | None = None
        #: When the running daemon last got SIGUSR1 (monotonic; its adoption time when
        #: adopted: unknown, possibly recent), or None: not since it started.
        self._signalled: float | None = None

    # -- reading ---------------------------------------------------------------------------

    @property
    def domain(self) -> Domain | None:
        raw = self._state.get("domain")
        if not isinstance(raw, dict):
            return None
        pid = raw.get("pid")
        return Domain(id=str(raw.get("id")),
                      peers=tuple(None if p is None else str(p) for p in raw.get("peers", [])),
                      pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                      reconnect=raw.get("reconnect") is True)

    @property
    def unreadable(self) -> str | None:
        """Why the domain state cannot be trusted (read now, or at an earlier start and not
        yet accepted by an operator), or None."""
        kept = self._state.get("unreadable")
        return self._state.problem or (str(kept) if kept is not None else None)

    def holders(self) -> tuple[str, ...]:
        """The claims holding the channel (every claim of the domain on this node)."""
        return self._ledger.holders(CHANNEL_KEY)

    def check_usable(self) -> str:
        """This node's IMEX address; :class:`ImexNotConfigured` without one, and
        :class:`StateUnreadable` while the domain state is unreadable."""
        if self.settings.address is None:
            raise ImexNotConfigured(
                "this node has no IMEX address: set --imex-address (GPU_AGENT_IMEX_ADDRESS, "
                "or imex_address in the config file) to the address its IMEX daemon listens "
                "on, then restart the agent")
        problem = self.unreadable
        if problem is not None:
            raise StateUnreadable(
                f"the compute-domain state is unreadable ({problem}); domain calls are "
                "refused until an operator checks this node's IMEX daemon (nvidia-imex-ctl "
                f"-c {self.files.config} -q), stops it if it should not run, and accepts "
                "empty domain state with POST /v1/admin/domain-state",
                path=str(self._state.path), reason=problem)
        return self.settings.address

    async def views(self) -> list[DomainView]:
        """The domain (0 or 1) with its daemon and the domain as IMEX sees it."""
        address = self.check_usable()
        domain = self.domain
        if domain is None:
            return []
        return [await self._view(domain, address)]

    async def view(self, domain_id: str) -> DomainView:
        address = self.check_usable()
        domain = self.domain
        if domain is None or domain.id != domain_id:
            raise NotFound(f"this node is not in compute domain {domain_id!r}")
        return await self._view(domain, address)

    async def _view(self, domain: Domain, address: str) -> DomainView:
        pid = domain.pid if domain.pid is not None and \
            self._control.runs(domain.pid, self.files.config) else None
        seen = None
        if pid is not None:
            seen = self._seen if self._seen is not None and self._seen.pid == pid \
                else await self._observe(pid)
        state: DaemonState = "running" if pid else "failed" if self._failure else "stopped"
        return DomainView(domain=domain, address=address,
                          daemon=DaemonView(state=state, pid=pid,
                                            imex_state=seen.imex_state if seen else None,
                                            reason=None if pid else self._failure),
                          imex=seen.imex if seen else None, holders=self.holders())

    async def _observe(self, pid: int) -> _Seen:
        """Ask the daemon now (``-q``, ``-N -j``) and keep the answer for the next view."""
        self._seen = _Seen(pid, await self._control.state(self.files.config),
                           await self._control.domain(self.files.config))
        return self._seen

    # -- the domain ------------------------------------------------------------------------

    async def configure(self, domain_id: str,
                        peers: Sequence[str | None]) -> tuple[DomainView, bool]:
        """PUT a domain's seats (each a member's address, or None); whether it changed
        anything. A second domain is :class:`DomainBusy`; the same seats again change
        nothing; other addresses for as many seats are stored and, when the daemon runs,
        written to its hosts file in place and the daemon told to reconnect (no restart); a
        new size restarts a running daemon once (IMEX reads its node list only at start)."""
        address = self.check_usable()
        errors = peer_errors(peers, address)
        if errors:
            raise InvalidRequest("; ".join(f"{e['field']}: {e['reason']}" for e in errors),
                                 errors)
        async with self._lock:
            current = self.domain
            if current is not None and current.id != domain_id:
                raise DomainBusy(f"this node is in compute domain {current.id!r} (one domain "
                                 "at a time): unprepare its claims first (DELETE "
                                 f"/v1/domains/{current.id} once none holds it)",
                                 domain=current.id, holders=self.holders())
            wanted = tuple(peers)
            if current is not None and current.peers == wanted:
                return await self._view(current, address), False
            running = current is not None and current.pid is not None and \
                self._control.runs(current.pid, self.files.config)
            domain = Domain(id=domain_id, peers=wanted, pid=current.pid if current else None,
                            reconnect=current.reconnect if current else False)
            restarted = reconnected = False
            if running and current is not None and len(current.peers) == len(wanted) and \
                    await self._names_in_use(current):
                domain = replace(domain, reconnect=True)
                await self._store(domain)
                self._seen = None
                await asyncio.to_thread(rewrite_in_place, self.files.hosts,
                                        render_hosts(domain.names, domain.peers).encode())
                await self._signal_if_due()
                reconnected = True
            else:
                await self._store(replace(domain, reconnect=False))
                if running and current is not None and current.pid is not None:
                    await self._control.stop(current.pid, self.files.config)
                    await self._start(self.domain or domain, address)
                    restarted = True
            held = sum(p is not None for p in wanted)
            self._events.append(
                "domain.configured", f"compute domain {domain_id}: {len(wanted)} seat(s), "
                f"{held} held{'; daemon restarted with the new list' if restarted else ''}"
                f"{'; hosts file rewritten, daemon reconnects' if reconnected else ''}",
                details={"domain": domain_id, "peers": list(wanted), "restarted": restarted,
                         "reconnected": reconnected})
            stored = self.domain
            assert stored is not None
            return await self._view(stored, address), True

    async def _names_in_use(self, domain: Domain) -> bool:
        """Whether the running daemon's node list is this domain's seat names and its hosts
        file is in place (a daemon started by an older agent lists addresses: it needs a
        restart to take a change)."""
        files = self.files

        def check() -> bool:
            try:
                return files.nodes.read_text() == render_nodes(domain.names) and \
                    files.hosts.is_file() and not files.hosts.is_symlink()
            except (OSError, UnicodeDecodeError):
                return False
        return await asyncio.to_thread(check)

    async def _signal_if_due(self) -> None:
        """Send the pending SIGUSR1 if IMEX would take it now (under the lock); otherwise
        supervision sends it once the window has passed."""
        domain = self.domain
        if domain is None or domain.pid is None:
            return
        now = self._clock()
        at = next_signal(self._signalled, now, pending=domain.reconnect)
        if at is None or at > now:
            return
        if not self._control.reconnect(domain.pid, self.files.config):
            return  # it stopped: the restart reads the hosts file anew
        self._signalled = now
        await self._store(replace(domain, reconnect=False))
        self._metrics.imex_reconnects.inc()
        self._events.append("domain.daemon_reconnected", f"compute domain {domain.id}: IMEX "
                            f"daemon (pid {domain.pid}) told to reconnect (SIGUSR1) to the "
                            "seats' current addresses",
                            details={"domain": domain.id, "pid": domain.pid})

    def next_check_s(self, interval_s: float) -> float:
        """How long supervision sleeps: ``interval_s``, or less when a SIGUSR1 is due
        sooner."""
        domain = self.domain
        if domain is None:
            return interval_s
        now = self._clock()
        at = next_signal(self._signalled, now, pending=domain.reconnect)
        return interval_s if at is None else min(interval_s, max(_POLL_S, at - now))

    async def leave(self, domain_id: str) -> bool:
        """Forget a domain no claim holds here (a job that ended before any pod was prepared,
        claims lost in a reboot): its daemon stopped, its files removed. Whether there was
        one; :class:`DomainBusy` while claims hold its channel (unprepare them)."""
        self.check_usable()
        async with self._lock:
            domain = self.domain
            if domain is None or domain.id != domain_id:
                return False
            holders = self.holders()
            if holders:
                raise DomainBusy(f"compute domain {domain_id!r} is held by claim "
                                 f"{', '.join(holders)} on this node: unprepare them first",
                                 domain=domain_id, holders=holders)
            await self._stop(domain)
            await self._store(None)
            self._events.append("domain.left", f"compute domain {domain_id}: removed (no "
                                "claim held it); IMEX daemon stopped",
                                details={"domain": domain_id})
            return True

    async def _store(self, domain: Domain | None) -> None:
        if domain is None:
            await self._state.delete("domain")
        else:
            await self._state.set("domain", {"id": domain.id, "peers": list(domain.peers),
                                              "pid": domain.pid,
                                              "reconnect": domain.reconnect})

    # -- channels, for the claims service --------------------------------------------------

    def reserve(self, uid: str, domain_id: str) -> None:
        """Hold channel 0 for claim ``uid`` of ``domain_id`` (no await): the domain must be
        this node's (:class:`DomainUnknown` when none was given, :class:`DomainBusy` when
        another one is)."""
        self.check_usable()
        current = self.domain
        if current is None:
            raise DomainUnknown(f"compute domain {domain_id!r} is not configured on this node: "
                                f"PUT /v1/domains/{domain_id} with its peers first",
                                domain=domain_id, claim=uid)
        if current.id != domain_id:
            raise DomainBusy(f"this node is in compute domain {current.id!r}, not "
                             f"{domain_id!r} (one domain at a time)", domain=current.id,
                             claim=uid)
        self.hold(uid, state="reserved")

    def hold(self, uid: str, *, state: HoldState = "prepared") -> None:
        """Put claim ``uid``'s hold on the channel in the ledger (also at start-up)."""
        self._ledger.take(Hold(uid, CHANNEL_KEY, state, shares=(Share(_SHARE, 1),)),
                          name=CHANNEL_NAME, capacity=_UNBOUNDED)

    async def ready(self, domain_id: str) -> None:
        """Return once this node's daemon runs and answers READY: started if it is not
        running, waited for up to ``--imex-ready-timeout-s``; else :class:`ImexUnavailable`
        with the daemon's message."""
        address = self.check_usable()
        async with self._lock:
            domain = self.domain
            if domain is None or domain.id != domain_id:
                raise DomainUnknown(f"compute domain {domain_id!r} went away",
                                    domain=domain_id)
            if domain.pid is None or not self._control.runs(domain.pid, self.files.config):
                await self._start(domain, address)
            await self._wait_ready(domain_id)

    async def released(self, domain_id: str, *, leave: bool) -> None:
        """After a claim of the domain released its hold: with no holder left, stop the
        daemon and remove its files, and with ``leave`` (an unprepare) forget the domain."""
        if not self._recovered or self.holders():
            return
        async with self._lock:
            domain = self.domain
            if domain is None or domain.id != domain_id or self.holders():
                return
            failure = self._failure
            await self._stop(domain)
            if leave:
                await self._store(None)
                self._events.append("domain.left", f"compute domain {domain_id}: the last "
                                    "claim on this node was unprepared; IMEX daemon stopped",
                                    details={"domain": domain_id})
            else:  # a failed prepare: why the daemon failed stays shown
                self._failure = failure
                await self._store(Domain(id=domain.id, peers=domain.peers, pid=None))

    # -- the daemon ------------------------------------------------------------------------

    async def _start(self, domain: Domain, address: str) -> None:
        """Write the config, node list and hosts file, start the daemon, record its pid. No
        daemon runs here: the hosts file may be replaced (the new daemon binds the new
        one)."""
        files = self.files
        await asyncio.to_thread(files.directory.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(write_atomic, files.nodes,
                                render_nodes(domain.names).encode())
        await asyncio.to_thread(write_atomic, files.hosts,
                                render_hosts(domain.names, domain.peers).encode())
        await asyncio.to_thread(write_atomic, files.config, render_config(
            files, address=address, port=self.settings.port).encode())
        try:
            self._seen = None
            await self._control.start(files.config, files.hosts)
        except ImexUnavailable as err:
            self._failure = err.detail
            self._metrics.imex_daemon_up.set(0)
            err.domain = domain.id
            raise
        pid = self._control.find(files.config)
        if pid is None:
            self._failure = "nvidia-imex exited 0 but no daemon runs with its config"
            raise ImexUnavailable(f"compute domain {domain.id}: {self._failure}",
                                  reason="not started", domain=domain.id)
        self._failure = None
        self._signalled = None
        await self._store(Domain(id=domain.id, peers=domain.peers, pid=pid))
        self._metrics.imex_daemon_up.set(1)
        self._events.append("domain.daemon_started", f"compute domain {domain.id}: IMEX "
                            f"daemon started (pid {pid})",
                            details={"domain": domain.id, "pid": pid})

    async def _wait_ready(self, domain_id: str) -> None:
        timeout = self.settings.ready_timeout_s
        deadline = time.monotonic() + timeout
        state = None
        while True:
            state = await self._control.state(self.files.config)
            if state == "READY":
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        raise ImexUnavailable(
            f"compute domain {domain_id}: the IMEX daemon is not READY after {timeout:g} s "
            f"(nvidia-imex-ctl -q: {state or 'no answer'}); nothing was prepared",
            reason="not ready", domain=domain_id)

    async def _stop(self, domain: Domain) -> None:
        """Stop the daemon (SIGTERM, bounded wait, SIGKILL) and remove its files."""
        pid = domain.pid if domain.pid is not None else self._control.find(self.files.config)
        if pid is not None:
            await self._control.stop(pid, self.files.config)
        await self._remove_files()
        self._failure = None
        self._metrics.imex_daemon_up.set(0)
        for state in ("READY", "UNAVAILABLE", "other"):
            self._metrics.imex_domain_nodes.labels(state).set(0)

    async def _remove_files(self) -> None:
        files = self.files
        for path in (files.config, files.nodes, files.hosts, files.log, files.socket):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(path.unlink)

    # -- start-up and supervision ----------------------------------------------------------

    async def recover(self) -> None:
        """At start-up, after the claims are reconciled (their holds are the daemon's): a
        running daemon with holders is re-adopted, a dead one restarted; one without holders
        (an interrupted unprepare or prepare) is stopped and the domain forgotten; a daemon
        of ours without domain state is stopped."""
        try:
            if self.settings.address is None:
                return
            problem = self._state.problem
            if problem is not None:
                # Kept in the (now empty) state, so a restart still fails closed.
                with contextlib.suppress(OSError):
                    await self._state.set("unreadable", problem)
                self._events.append("domain.state_unreadable", f"{problem}; domain calls "
                                    "are refused until an operator acts",
                                    severity=Severity.ERROR)
                return
            if self.unreadable is not None:
                return
            async with self._lock:
                await self._recover()
        finally:
            self._recovered = True

    async def _recover(self) -> None:
        address = self.settings.address
        assert address is not None
        domain = self.domain
        if domain is None:
            stray = self._control.find(self.files.config)
            if stray is not None:
                await self._control.stop(stray, self.files.config)
                await self._remove_files()
            return
        pid = domain.pid if domain.pid is not None and \
            self._control.runs(domain.pid, self.files.config) else \
            self._control.find(self.files.config)
        holders = self.holders()
        if not holders:
            if pid is not None:
                await self._stop(Domain(domain.id, domain.peers, pid))
                await self._store(None)
                self._events.append("domain.left", f"compute domain {domain.id}: no claim "
                                    "holds it after the restart; IMEX daemon stopped",
                                    details={"domain": domain.id})
            return
        if pid is not None and await self._control.state(self.files.config) is not None:
            if pid != domain.pid:
                await self._store(replace(domain, pid=pid))
            # Whether the last agent signalled it, and when, is unknown: possibly just now.
            self._signalled = self._clock()
            await self._sync_hosts()
            self._metrics.imex_daemon_up.set(1)
            self._events.append("domain.daemon_adopted", f"compute domain {domain.id}: IMEX "
                                f"daemon (pid {pid}) still runs; adopted",
                                details={"domain": domain.id, "pid": pid})
            return
        await self._restart(domain, address, why="was not running when the agent started")

    async def _sync_hosts(self) -> None:
        """After adoption: a hosts file the last agent did not finish writing is written
        again in place, and the daemon told (once the window passed)."""
        domain = self.domain
        if domain is None or not await self._names_in_use(domain):
            return
        wanted = render_hosts(domain.names, domain.peers).encode()
        try:
            written = await asyncio.to_thread(self.files.hosts.read_bytes)
        except OSError:
            return
        if written != wanted:
            await self._store(replace(domain, reconnect=True))
            self._seen = None
            await asyncio.to_thread(rewrite_in_place, self.files.hosts, wanted)

    async def _restart(self, domain: Domain, address: str, *, why: str) -> None:
        """Start the daemon again for its holders, with an event and a metric; a failure is
        reported (event, daemon ``failed``) and retried by the next supervision round."""
        self._metrics.imex_daemon_restarts.inc()
        before = self._failure
        try:
            if domain.pid is not None:
                await self._control.stop(domain.pid, self.files.config)
            await self._start(domain, address)
        except (AgentError, OSError) as err:
            detail = err.detail if isinstance(err, AgentError) else str(err)
            repeated = before == detail
            self._failure = detail
            if repeated:  # retried every round: said once, while it fails the same way
                return
            self._events.append("domain.daemon_failed", f"compute domain {domain.id}: the "
                                f"IMEX daemon {why} and could not be restarted: {detail}",
                                severity=Severity.ERROR, details={"domain": domain.id})
            return
        pid = self.domain.pid if self.domain else None
        self._events.append("domain.daemon_restarted", f"compute domain {domain.id}: the IMEX "
                            f"daemon {why}; restarted (pid {pid})", severity=Severity.WARNING,
                            details={"domain": domain.id, "pid": pid})

    async def check(self) -> None:
        """One supervision round: a dead daemon with holders is restarted; the gauges follow
        the daemon and the domain as IMEX sees it."""
        address = self.settings.address
        if address is None or self.unreadable is not None or not self._recovered:
            return
        async with self._lock:
            domain = self.domain
            if domain is None or not self.holders():
                return
            if domain.pid is None or not self._control.runs(domain.pid, self.files.config):
                await self._restart(domain, address, why="stopped running")
                return
            await self._signal_if_due()
            pid = domain.pid
        view = (await self._observe(pid)).imex
        self._metrics.imex_daemon_up.set(1)
        counts = {"READY": 0, "UNAVAILABLE": 0, "other": 0}
        for node in view.nodes if view else ():
            counts[node.status if node.status in counts else "other"] += 1
        for state, count in counts.items():
            self._metrics.imex_domain_nodes.labels(state).set(count)

    async def supervise(self, interval_s: float) -> None:
        """:meth:`check` every ``interval_s``, sooner when a deferred SIGUSR1 is due (a task
        of the node)."""
        while True:
            await asyncio.sleep(self.next_check_s(interval_s))
            try:
                await self.check()
            except (AgentError, OSError) as err:
                log.warning("IMEX daemon check failed", extra={"error": str(err)})

    async def accept_empty_state(self) -> None:
        """An operator's answer to unreadable domain state: start from none (the kept-aside
        file stays). Refused while the state is readable."""
        if self.unreadable is None:
            raise Conflict("the compute-domain state is readable: nothing to accept")
        self._state = DurableMap(self._state.path, format="gpu-agent-imex-domain")
        await self._state.delete("unreadable")
        await self._state.delete("domain")
        self._events.append("domain.state_accepted", "compute-domain state replaced by an "
                            "empty one", severity=Severity.WARNING)
        await self.recover()
