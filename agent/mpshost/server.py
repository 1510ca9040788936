"""``gpu-agent mps-host``: the long-lived process that starts MPS control daemons for the
agent, so that they live in its cgroup rather than the agent's and outlive agent restarts.

It listens on a Unix socket (mode 0660 with ``--socket-group``, else 0600), answers only
root, its own user and members of the socket's group (``SO_PEERCRED``, and the peer's
supplementary groups from ``/proc``), checks each launch against
:class:`~agent.mpshost.policy.LaunchPolicy`, opens its directories without following a
symlink (:mod:`agent.mpshost.directories`) and runs it confined to them
(:mod:`agent.mpshost.confine`) with :class:`~agent.mps.direct.DirectLauncher`. Everything
else about a daemon (its commands, ``quit``) the agent does itself through the pipe
directory. With ``--imex`` it also starts the node's IMEX daemon (op ``launch-imex``, checked
by :class:`~agent.mpshost.imex.ImexPolicy`, its files opened by
:func:`~agent.mpshost.directories.opened_files`, run by ``DirectLauncher.launch_imex``), so
that daemon too lives in the host's cgroup. Peers are served concurrently, at most
``max_connections`` open at once (the oldest one still waiting for its request line makes
room for a new one; see
:mod:`agent.mps.protocol`). On SIGTERM it stops accepting, lets the launches in flight
finish, removes its socket and exits; it never stops a daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.mps import protocol
from agent.mps.direct import DirectLauncher
from agent.mpshost import confine, directories
from agent.mpshost.imex import ImexPolicy
from agent.mpshost.policy import (
    LOG,
    PIPE,
    LaunchPlan,
    LaunchPolicy,
    Malformed,
    Refused,
    printable,
)

log = logging.getLogger("agent.mpshost")

#: Connections open at once (each a descriptor and a task); over it, room is made by
#: dropping the oldest one that has not sent its request, or the new one is answered busy.
MAX_CONNECTIONS = 64
#: Launches run at once (each is a short-lived ``-d`` parent).
MAX_LAUNCHES = 4
#: How long SIGTERM waits for launches in flight.
DRAIN_S = 20.0
_SELINUX_XATTR = "security.selinux"


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """The connecting process's credentials, as the kernel recorded them at connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


def group_id(group: str) -> int:
    """A group name or number as its gid; ValueError when there is no such group."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as err:
        raise ValueError(f"no group {group!r}") from err


class MpsHost:
    """The server: bind with :meth:`start`, then :meth:`serve` until ``stop`` is set."""

    def __init__(self, policy: LaunchPolicy, *, socket_path: Path, socket_group: int | None,
                 selinux_context: str | None = None, launcher: DirectLauncher | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 imex: ImexPolicy | None = None) -> None:
        self.policy = policy
        self.imex = imex or ImexPolicy()
        self.socket_path = socket_path
        self.socket_group = socket_group
        self.selinux_context = selinux_context
        self.max_connections = max_connections
        self._launcher = launcher or DirectLauncher()
        self._server: asyncio.AbstractServer | None = None
        self._launches = asyncio.Semaphore(MAX_LAUNCHES)
        #: Every open connection's task, oldest first, to whether it still waits for its
        #: request line (only those may be dropped to make room).
        self._tasks: dict[asyncio.Task[Any], bool] = {}
        self._dropped: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Check that daemons can be confined, then bind the socket. A stale socket file is
        replaced; one that a running host answers on is not (AgentError: two hosts would race
        for the same daemons)."""
        probe = await self._launcher.launch(confine.probe_command(), {}, timeout_s=30.0)
        if probe.returncode != 0:
            raise AgentError("cannot give daemons mount namespaces of their own, which confine "
                             "each to its directories (the MPS host needs CAP_SYS_ADMIN): "
                             f"{probe.output.strip() or f'exit status {probe.returncode}'}")
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise AgentError(f"{path} exists and is not a socket")
            if await _answers(path):
                raise AgentError(f"another mps-host answers on {path}")
            path.unlink()
        # Bind under a umask that leaves no moment of a wider mode.
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._accept, path=str(path), limit=protocol.MAX_LINE)
        finally:
            os.umask(old)
        if self.socket_group is not None:
            os.chown(path, -1, self.socket_group)
            os.chmod(path, 0o660)
        log.info("mps-host listening", extra={
            "socket": str(path), "socket_group": self.socket_group,
            "max_connections": self.max_connections, **self._describe()})

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; then stop accepting, drain, remove the socket."""
        assert self._server is not None, "start() first"
        await stop.wait()
        self._server.close()
        log.info("mps-host stopping: no new connections; daemons keep running",
                 extra={"in_flight": len(self._tasks)})
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=DRAIN_S)
            for task in pending:
                task.cancel()
        await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        log.info("mps-host stopped")

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = True
        try:
            if len(self._tasks) > self.max_connections and not self._make_room(task):
                log.warning("mps-host busy: a connection over the cap was answered busy",
                            extra={"max_connections": self.max_connections})
                reply = protocol.refusal("busy", f"{self.max_connections} connections are "
                                                 "open with requests in progress; try again")
            else:
                reply = await self._served(task, reader, writer)
            writer.write(protocol.encode(reply))
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.drain(), protocol.READ_TIMEOUT_S)
        except (ConnectionError, TimeoutError, protocol.ProtocolError) as err:
            log.warning("mps-host connection dropped", extra={"reason": str(err)})
        finally:
            del self._tasks[task]
            self._dropped.discard(task)
            writer.close()

    def _make_room(self, newcomer: asyncio.Task[Any]) -> bool:
        """Drop the oldest connection that has not sent its request yet (its read is
        cancelled, it is answered busy); False when every other one is at work."""
        oldest = next((t for t, waiting in self._tasks.items()
                       if waiting and t is not newcomer and t not in self._dropped), None)
        if oldest is None:
            return False
        self._dropped.add(oldest)
        oldest.cancel()
        return True

    async def _served(self, task: asyncio.Task[Any], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> dict[str, Any]:
        """The reply to one connection: its request's answer, busy when it was dropped to
        make room, ``failed`` naming an internal error rather than no answer at all."""
        try:
            return await self._answer(task, reader, writer)
        except asyncio.CancelledError:
            if task not in self._dropped:
                raise
            task.uncancel()
            log.warning("mps-host busy: dropped the oldest connection without a request",
                        extra={"max_connections": self.max_connections})
            return protocol.refusal("busy", f"{self.max_connections} connections are open; "
                                            "this one had sent no request and made room")
        except Exception as err:  # a bug costs one answer, never an unanswered peer
            log.error("mps-host internal error", extra={"error": f"{type(err).__name__}: "
                                                                 f"{err}"})
            return protocol.refusal("failed", f"internal error ({type(err).__name__})")

    async def _answer(self, task: asyncio.Task[Any], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> dict[str, Any]:
        peer = peer_of(writer.get_extra_info("socket"))
        try:
            # The line is read (bounded) before the peer is judged, so that a refused peer
            # gets its answer instead of a reset for unread data.
            line = await asyncio.wait_for(reader.readline(), protocol.READ_TIMEOUT_S)
            self._tasks[task] = False
            if not self._allowed(peer):
                log.warning("mps-host refused a peer", extra={
                    "peer_pid": peer.pid, "peer_uid": peer.uid, "peer_gid": peer.gid})
                return protocol.refusal("forbidden", f"uid {peer.uid} gid {peer.gid} is "
                                                     "neither root nor in the socket's group")
            request = protocol.decode(line)
        except TimeoutError:
            return protocol.refusal("bad-request", "no request line within "
                                                   f"{protocol.READ_TIMEOUT_S:g} s")
        except protocol.ProtocolError as err:
            return protocol.refusal("bad-request", f"request line: {err}")
        except (ValueError, asyncio.LimitOverrunError):
            # readline raises ValueError past the stream's limit (MAX_LINE).
            return protocol.refusal("bad-request", f"request is not one JSON line of at "
                                                   f"most {protocol.MAX_LINE} bytes")
        if request.get("v") != protocol.VERSION:
            return protocol.refusal("version", f"protocol version {request.get('v')!r} is "
                                               f"not spoken here (only {protocol.VERSION})",
                                    "v")
        op = request.get("op")
        if op == "ping":
            return {"ok": True, **self._describe()}
        if op == "launch":
            return await self._launch(request, peer)
        if op == "launch-imex":
            return await self._launch_imex(request, peer)
        return protocol.refusal("bad-request", f"unknown op {op!r} "
                                               f"({', '.join(protocol.OPS)})", "op")

    def _describe(self) -> dict[str, Any]:
        return {**self.policy.describe(), **self.imex.describe()}

    def _allowed(self, peer: Peer) -> bool:
        if peer.uid in (0, os.getuid()):
            return True
        if self.socket_group is None:
            return False
        return peer.gid == self.socket_group or self.socket_group in _groups_of(peer.pid)

    async def _launch(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        timeout_s = _timeout(request)
        if timeout_s is None:
            return _bad_timeout()
        try:
            plan = self.policy.check(request.get("argv"), request.get("env"))
        except Refused as err:
            return _refusal(err, peer)
        try:
            async with self._launches:
                # Opened right before the start: what is open is what the daemon gets.
                with directories.opened(plan) as opened:
                    if self.selinux_context:
                        self._label(opened.pipe, opened.shm)
                    bound = _bound(plan, opened)
                    result = await self._launcher.launch(
                        confine.command(root=str(plan.root), bound=bound, argv=plan.argv,
                                        env=plan.env),
                        {}, timeout_s=float(timeout_s), pass_fds=[b.fd for b in bound])
        except Refused as err:
            return _refusal(err, peer)
        except (AgentError, OSError) as err:
            reason = getattr(err, "detail", None) or str(err)
            log.warning("mps-host launch failed", extra={"pipe": plan.env[PIPE],
                                                         "reason": reason})
            return protocol.refusal("failed", reason)
        log.info("mps daemon launched", extra={
            "pipe": plan.env[PIPE], "returncode": result.returncode,
            "devices": plan.env.get("CUDA_VISIBLE_DEVICES", ""),
            "private_shm": plan.private_shm, "peer_pid": peer.pid})
        return {"ok": True, "returncode": result.returncode, "output": result.output}

    async def _launch_imex(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        extra = sorted(str(k) for k in request if k not in protocol.IMEX_KEYS)
        if extra:
            return _refusal(Malformed(printable(extra[0])[:80], "unknown field (launch-imex "
                                    f"takes {', '.join(protocol.IMEX_KEYS[2:])})"), peer)
        timeout_s = _timeout(request)
        if timeout_s is None:
            return _bad_timeout()
        try:
            plan = self.imex.check(request.get("imex"), request.get("config"),
                                   request.get("hosts"))
        except Refused as err:
            return _refusal(err, peer)
        try:
            async with self._launches:
                # Opened right before the start (each component without following a
                # symlink, regular files): the daemon reads the config by the agent's path
                # (the agent finds it by its argv), and the namespace script opens the hosts
                # file again, O_NOFOLLOW, to bind it at /etc/hosts.
                with directories.opened_files(plan):
                    result = await self._launcher.launch_imex(
                        plan.imex, plan.config, str(plan.root.joinpath(*plan.hosts_parts)),
                        timeout_s=timeout_s)
        except Refused as err:
            return _refusal(err, peer)
        except (AgentError, OSError) as err:
            reason = getattr(err, "detail", None) or str(err)
            log.warning("mps-host imex launch failed", extra={"config": plan.config,
                                                              "reason": reason})
            return protocol.refusal("failed", reason)
        log.info("imex daemon launched", extra={
            "config": plan.config, "hosts": plan.hosts, "returncode": result.returncode,
            "peer_pid": peer.pid})
        return {"ok": True, "returncode": result.returncode, "output": result.output}

    def _label(self, *fds: int | None) -> None:
        """Give the pipe and shm directories the SELinux context containers may use (the
        daemon's sockets and files inherit it), before the daemon creates anything."""
        assert self.selinux_context is not None
        for fd in fds:
            if fd is not None:
                os.setxattr(fd, _SELINUX_XATTR, self.selinux_context.encode())


def _timeout(request: dict[str, Any]) -> float | None:
    """The request's ``timeout_s`` (15 s when absent), None when it is no number of seconds
    the host allows."""
    timeout_s = request.get("timeout_s", 15.0)
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) \
            or not 0 < timeout_s <= protocol.MAX_LAUNCH_TIMEOUT_S:
        return None
    return float(timeout_s)


def _bad_timeout() -> dict[str, Any]:
    return protocol.refusal("bad-request", "must be a number of seconds in (0, "
                            f"{protocol.MAX_LAUNCH_TIMEOUT_S:g}]", "timeout_s")


def _refusal(err: Refused, peer: Peer) -> dict[str, Any]:
    log.warning("mps-host refused a launch", extra={
        "field": err.field, "reason": err.reason, "kind": err.kind, "peer_pid": peer.pid})
    return protocol.refusal(err.kind, err.reason, err.field)


def _bound(plan: LaunchPlan, opened: directories.OpenedDirectories) -> list[confine.Bound]:
    """The opened directories as the daemon gets them (:mod:`agent.mpshost.confine`): pipe
    and log at their own paths, shm at /dev/shm with ``--private-shm``."""
    bound = [confine.Bound(plan.pipe, opened.pipe, plan.env[PIPE]),
             confine.Bound(plan.log, opened.log, plan.env[LOG])]
    if plan.private_shm:
        assert opened.shm is not None
        bound.append(confine.Bound(plan.shm, opened.shm, "/dev/shm"))
    return bound


def _groups_of(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (none when it is gone): a member of the
    socket's group through a supplementary group is a member too."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


async def _answers(path: Path) -> bool:
    """Whether a host answers ``ping`` on ``path`` (within a second)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(protocol.encode({"op": "ping"}))
        line = await asyncio.wait_for(reader.readline(), 1.0)
        return bool(protocol.decode(line).get("ok"))
    except (OSError, TimeoutError, protocol.ProtocolError):
        return False
    finally:
        writer.close()


async def run(host: MpsHost) -> int:
    """Start ``host`` and serve it until SIGTERM or SIGINT; 0 on a clean stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await host.start()
    await host.serve(stop)
    return 0
