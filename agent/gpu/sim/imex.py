"""A simulated ``nvidia-imex``: a real daemon process behaving as NVIDIA's IMEX guide
documents it (``docs/compute-domains.md`` lists what is simulated and what is assumed).

- ``nvidia-imex -c <config>`` reads the config file and the node config file it names, once
  (a change needs a restart). ``DAEMONIZE=1`` detaches; the starter exits 0 once the daemon
  listens, 1 with a one-line error otherwise.
- It listens on ``BIND_INTERFACE_IP:SERVER_PORT`` (TCP) and keeps one connection to every
  other node of the list, re-resolving names at each attempt; 127.0.0.x addresses make
  several simulated nodes on one machine distinct peers on the same port.
- ``IMEX_WAIT_FOR_QUORUM=FULL`` holds it in ``WAITING_FOR_PEERS`` until every node is
  connected; ``NONE`` and ``RECOVERY`` are ``READY`` at once (no memory is ever exported
  here, so there is no importer to wait for).
- A lost peer shows ``R`` (recovering) until it reconnects, or ``D`` once
  ``IMEX_NODE_DISCONNECTED_GRACE_TIME`` passed; peers with a different node list refuse each
  other (``M``).
- SIGTERM, SIGINT, SIGQUIT: tell the peers, close, exit 0. SIGHUP: write the messages above
  ``LOG_LEVEL`` kept in memory to the log. SIGUSR1 (at most once per 5 s): restart every
  outgoing connection.
- With ``IMEX_CMD_ENABLED=1`` a command service (TCP ``IMEX_CMD_PORT``, or the Unix socket
  ``IMEX_CMD_UNIX_DOMAIN_PATH``) answers ``nvidia-imex-ctl``.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NoReturn

from agent.gpu.sim import wire
from agent.gpu.sim.detach import detach
from agent.gpu.sim.imex_config import (
    ConfigError,
    ImexConfig,
    nodes_key,
    parse_config,
    parse_nodes,
)

VERSION = "sim"
USAGE = "Usage: nvidia-imex [-c <config file>] [-h]"
HEARTBEAT_S = 0.2
CONNECT_TIMEOUT_S = 1.0
RECONNECT_MAX_S = 1.0
USR1_WINDOW_S = 5.0
READY_TIMEOUT_S = 10.0
_LEVELS = {1: "FATAL", 2: "ERROR", 3: "WARNING", 4: "INFO"}
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1}


class Peer:
    """Another node of the list, as this daemon sees it."""

    def __init__(self, address: str) -> None:
        self.address = address
        #: N never connected, C connected, R lost (no clean-up yet), D cleaned up,
        #: M node map mismatch.
        self.link = "N"
        self.lost_at = 0.0
        self.instance: str | None = None
        #: What the peer last told us over its own connection to us (None: not connected).
        self.state: str | None = None
        self.view: dict[str, str] = {}
        self.outgoing: socket.socket | None = None


class Daemon:
    def __init__(self, config: ImexConfig, nodes: tuple[str, ...], me: str) -> None:
        self.config, self.nodes, self.me = config, nodes, me
        self.key = nodes_key(nodes)
        self.instance = uuid.uuid4().hex
        self.peers = {n: Peer(n) for n in nodes if n != me}
        self.state = "INITIALIZING"
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.verbose: collections.deque[str] = collections.deque(maxlen=10000)
        self.last_usr1 = -USR1_WINDOW_S

    # -- log ---------------------------------------------------------------------------

    def log(self, level: int, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        line = f"[{stamp}] [{_LEVELS[level]}] [pid {os.getpid()}] {message}"
        if level > self.config.log_level:
            self.verbose.append(line)
            return
        self._write([line])

    def _write(self, lines: list[str]) -> None:
        with contextlib.suppress(OSError), self.config.log_file_name.open("a") as out:
            out.write("".join(f"{line}\n" for line in lines))

    def flush_verbose(self) -> None:
        lines, self.verbose = list(self.verbose), collections.deque(maxlen=10000)
        self._write(["--- in-memory verbose log ---", *lines, "--- end ---"])

    # -- state -------------------------------------------------------------------------

    def view(self) -> dict[str, str]:
        return {n: "C" if n == self.me else self.peers[n].link for n in self.nodes}

    def settle(self) -> None:
        """Move to READY once the quorum the config asks for is there (under the lock)."""
        if self.state not in ("INITIALIZING", "WAITING_FOR_PEERS"):
            return
        if self.config.wait_for_quorum == "FULL" and \
                any(p.link != "C" for p in self.peers.values()):
            self.state = "WAITING_FOR_PEERS"
            return
        self.state = "READY"
        self.log(4, "IMEX daemon is READY")

    def domain(self) -> dict[str, Any]:
        """``nvidia-imex-ctl -N``'s answer: every node's state and links as seen from here."""
        with self.lock:
            rows: list[dict[str, Any]] = []
            for index, node in enumerate(self.nodes):
                if node == self.me:
                    status, links = self.state, self.view()
                else:
                    peer = self.peers[node]
                    status = peer.state or "UNAVAILABLE"
                    links = dict(peer.view) if peer.state else {}
                rows.append({"index": index, "host": node, "status": status,
                             "version": VERSION if status != "UNAVAILABLE" else "",
                             "connections": links})
            whole = all(r["status"] == "READY" for r in rows) and all(
                len(r["connections"]) == len(self.nodes)
                and set(r["connections"].values()) == {"C"} for r in rows)
            status = "DOWN" if self.state != "READY" else "UP" if whole else "DEGRADED"
            return {"status": status, "nodes": rows}

    # -- peers -------------------------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        return {"hello": {"node": self.me, "instance": self.instance, "nodes_key": self.key,
                          "version": VERSION}}

    def _status(self) -> dict[str, Any]:
        with self.lock:
            return {"status": {"state": self.state, "view": self.view()}}

    def _lost(self, peer: Peer, why: str) -> None:
        with self.lock:
            if peer.link == "C":
                peer.link, peer.lost_at = "R", time.monotonic()
                self.log(3, f"connection to node {peer.address} lost: {why}")
            peer.outgoing = None

    def connect_loop(self, peer: Peer) -> None:
        """Keep one connection to ``peer``; a heartbeat carries this node's state."""
        backoff = 0.05
        while not self.stop.is_set():
            self._expire(peer)
            try:
                sock = socket.create_connection((peer.address, self.config.server_port),
                                                timeout=CONNECT_TIMEOUT_S)
            except OSError:
                self.stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            try:
                self._session(peer, sock)
            except (OSError, ValueError) as err:
                self._lost(peer, str(err) or type(err).__name__)
            finally:
                sock.close()
            backoff = 0.05
            self.stop.wait(backoff)

    def _expire(self, peer: Peer) -> None:
        grace = self.config.node_disconnected_grace_time_s
        with self.lock:
            if peer.link == "R" and grace and time.monotonic() - peer.lost_at >= grace:
                peer.link = "D"
                self.log(3, f"node {peer.address}: grace time over, its imports cleaned up")

    def _session(self, peer: Peer, sock: socket.socket) -> None:
        sock.settimeout(CONNECT_TIMEOUT_S)
        wire.send(sock, self._hello())
        reader = sock.makefile("rb")
        reply = json.loads(reader.readline() or b"null")
        if not isinstance(reply, dict) or "welcome" not in reply:
            reason = reply.get("refused") if isinstance(reply, dict) else "no answer"
            with self.lock:
                if reason == "node map mismatch":
                    peer.link = "M"
                self.log(2, f"node {peer.address} refused the connection: {reason}")
            self.stop.wait(RECONNECT_MAX_S)
            return
        welcome = reply["welcome"]
        with self.lock:
            if peer.instance is not None and peer.instance != welcome.get("instance"):
                self.log(3, f"node {peer.address} is a new IMEX instance: its old "
                         "imports are cleaned up")
            peer.instance = welcome.get("instance")
            peer.link, peer.outgoing = "C", sock
            self.log(4, f"connected to node {peer.address}")
            self.settle()
        while not self.stop.is_set():
            wire.send(sock, self._status())
            readable, _, _ = select.select([sock], [], [], HEARTBEAT_S)
            if readable and not sock.recv(4096):
                raise ValueError("peer closed the connection")
            if peer.outgoing is not sock:
                raise ValueError("connection restarted (SIGUSR1)")
        with contextlib.suppress(OSError):
            wire.send(sock, {"bye": True})

    def serve_peer(self, conn: socket.socket) -> None:
        """One incoming connection: the peer's hello, then its heartbeats."""
        peer: Peer | None = None
        try:
            conn.settimeout(CONNECT_TIMEOUT_S * 5)
            reader = conn.makefile("rb")
            hello = json.loads(reader.readline() or b"null")
            hello = hello.get("hello") if isinstance(hello, dict) else None
            if not isinstance(hello, dict) or hello.get("node") not in self.peers:
                wire.send(conn, {"refused": "unknown node"})
                return
            if hello.get("nodes_key") != self.key:
                with self.lock:
                    self.log(2, f"node {hello['node']} has a different node map")
                wire.send(conn, {"refused": "node map mismatch"})
                return
            peer = self.peers[hello["node"]]
            wire.send(conn, {"welcome": {"node": self.me, "instance": self.instance}})
            while not self.stop.is_set():
                line = reader.readline()
                if not line:
                    break
                message = json.loads(line)
                if "bye" in message:
                    break
                status = message.get("status")
                if isinstance(status, dict):
                    with self.lock:
                        peer.state = str(status.get("state"))
                        peer.view = {str(k): str(v) for k, v in status.get("view", {}).items()}
        except (OSError, ValueError):
            pass
        finally:
            if peer is not None:
                with self.lock:
                    peer.state, peer.view = None, {}
            conn.close()

    def accept_loop(self, listener: socket.socket, serve: Any) -> None:
        listener.settimeout(HEARTBEAT_S)
        while not self.stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def restart_connections(self) -> None:
        now = time.monotonic()
        if now - self.last_usr1 < USR1_WINDOW_S:
            return
        self.last_usr1 = now
        with self.lock:
            self.log(4, "SIGUSR1: restarting outgoing connections")
            for peer in self.peers.values():
                peer.outgoing = None

    # -- command service ---------------------------------------------------------------

    def serve_command(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CONNECT_TIMEOUT_S * 5)
            request = json.loads(conn.makefile("rb").readline() or b"null")
            command = request.get("command") if isinstance(request, dict) else None
            if command == "q":
                with self.lock:
                    wire.send(conn, {"state": self.state})
            elif command == "N":
                wire.send(conn, self.domain())
            else:
                wire.send(conn, {"error": f"unknown command {command!r}"})
        except (OSError, ValueError):
            pass
        finally:
            conn.close()


def _addresses(entry: str) -> list[str]:
    """The addresses a node entry stands for: itself, or what its name resolves to now."""
    with contextlib.suppress(ValueError):
        return [str(ipaddress.ip_address(entry))]
    try:
        found = socket.getaddrinfo(entry, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def _bind(config: ImexConfig, nodes: tuple[str, ...]) -> tuple[str, socket.socket]:
    """This node's entry in the list and its server socket. BIND_INTERFACE_IP must be the
    address of an entry (a name resolving to it will do); without it, the first entry this
    machine can listen on (NVIDIA: the entry matching a local interface)."""
    bind_ip = config.bind_interface_ip
    if bind_ip:
        mine = [n for n in nodes if bind_ip in _addresses(n)]
        if not mine:
            raise ConfigError(f"{config.path}: BIND_INTERFACE_IP={bind_ip} is not the address "
                              f"of a node of {config.node_config_file}")
        candidates = [(mine[0], bind_ip)]
    else:
        candidates = [(n, a) for n in nodes for a in _addresses(n)[:1]]
    for entry, address in candidates:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, config.server_port))
            sock.listen(64)
            return entry, sock
        except OSError as err:
            sock.close()
            if bind_ip:
                raise ConfigError(f"cannot listen on {bind_ip}:{config.server_port}: "
                                  f"{err.strerror or err}") from None
    raise ConfigError(f"no node of {config.node_config_file} is an address of this machine "
                      f"free on port {config.server_port}")


def _command_listener(config: ImexConfig) -> socket.socket | None:
    if not config.cmd_enabled:
        return None
    try:
        if config.cmd_unix_domain_path is not None:
            return wire.listen(config.cmd_unix_domain_path)
        sock = socket.socket(socket.AF_INET6 if ":" in config.cmd_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.cmd_host, config.cmd_port))
        sock.listen(16)
        return sock
    except OSError as err:
        where = config.cmd_unix_domain_path or f"{config.cmd_host}:{config.cmd_port}"
        raise ConfigError(f"cannot serve the command service on {where}: "
                          f"{err.strerror or err}") from None


def run(path: Path, report: Any) -> int:
    """Become the daemon in this process; ``report('ok' | error)`` once listening."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        config = parse_config(path)
        nodes = parse_nodes(config.node_config_file)
        me, listener = _bind(config, nodes)
        commands = _command_listener(config)
    except ConfigError as err:
        report(f"error: {err}")
        return 1
    daemon = Daemon(config, nodes, me)
    daemon.log(4, f"IMEX daemon (simulated) started: node {me} ({nodes.index(me)} of "
               f"{len(nodes)}), port {config.server_port}, quorum {config.wait_for_quorum}")
    threads = [threading.Thread(target=daemon.accept_loop, args=(listener, daemon.serve_peer),
                                daemon=True)]
    if commands is not None:
        threads.append(threading.Thread(target=daemon.accept_loop,
                                        args=(commands, daemon.serve_command), daemon=True))
    threads += [threading.Thread(target=daemon.connect_loop, args=(p,), daemon=True)
                for p in daemon.peers.values()]
    for thread in threads:
        thread.start()
    with daemon.lock:
        daemon.settle()
    report("ok")
    while True:
        received = signal.sigtimedwait(_SIGNALS, HEARTBEAT_S)
        if received is None:
            continue
        if received.si_signo == signal.SIGHUP:
            daemon.flush_verbose()
        elif received.si_signo == signal.SIGUSR1:
            daemon.restart_connections()
        else:
            break
    with daemon.lock:
        daemon.state = "SHUTTING_DOWN"
        daemon.log(4, f"signal {signal.Signals(received.si_signo).name}: shutting down, "
                   "telling the peers")
    daemon.stop.set()
    for thread in threads:
        thread.join(timeout=2)
    listener.close()
    if commands is not None:
        commands.close()
        if config.cmd_unix_domain_path is not None:
            with contextlib.suppress(OSError):
                config.cmd_unix_domain_path.unlink()
    daemon.flush_verbose()
    daemon.log(4, "IMEX daemon exited")
    return 0


def _detach(path: Path) -> int:
    """``DAEMONIZE=1``: fork the daemon off (new session); exit once it listens."""
    def serve(report_fd: int) -> NoReturn:
        def report(text: str) -> None:
            with contextlib.suppress(OSError):
                os.write(report_fd, text.encode()[:4000])
                os.close(report_fd)

        os._exit(run(path, report))

    text = detach(serve, READY_TIMEOUT_S)
    if text == "ok":
        return 0
    message = text.removeprefix("error: ")
    print(f"nvidia-imex: {message or 'the daemon did not start'}", file=sys.stderr)
    return 1


def _check_driver() -> None:
    """The driver check IMEX makes at start, against the simulated driver where the node's
    wrapper names one: an injected ``nvidia-imex`` fault fails the start with its message, a
    latency delays it. Run without the wrapper, there is no driver to check."""
    path = os.environ.get("GPU_AGENT_SIM_DRIVER")
    if not path:
        return
    try:
        reply = wire.request(Path(path), {"op": "tool", "tool": "nvidia-imex"})
    except (OSError, ValueError) as err:
        raise ConfigError(f"the NVIDIA driver is not reachable ({path}: {err})") from None
    error = reply.get("error")
    if isinstance(error, dict):
        raise ConfigError(str(error.get("detail")))
    latency = float(reply.get("latency_s") or 0.0)
    if latency > 0:
        time.sleep(latency)
    if reply.get("fail"):
        raise ConfigError(str(reply["fail"]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args and (args[0] != "-c" or len(args) != 2):
        print(f"nvidia-imex: unknown arguments {' '.join(args)!r}\n{USAGE}", file=sys.stderr)
        return 2
    path = Path(args[1]) if args else Path("/etc/nvidia-imex/config.cfg")
    try:
        config = parse_config(path)
        _check_driver()
    except ConfigError as err:
        print(f"nvidia-imex: {err}", file=sys.stderr)
        return 1
    if config.daemonize:
        return _detach(path)

    def report(text: str) -> None:
        if text != "ok":
            print(f"nvidia-imex: {text.removeprefix('error: ')}", file=sys.stderr)

    return run(path, report)


if __name__ == "__main__":
    sys.exit(main())
