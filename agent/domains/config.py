"""The IMEX daemon's files for a domain, rendered from values (pure), and the checks of a
domain's seats.

A domain of N members has seats 0..N-1; the node list names each seat (:func:`seat_names`),
the same on every member, and the daemon's own ``/etc/hosts`` maps each held seat's name to
its member's address (:func:`render_hosts`), so a seat that moves to another node changes
the hosts file, never the node list."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: A domain id: a claim UID's alphabet.
DOMAIN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MAX_PEERS = 1024
#: A Unix socket path longer than this does not fit ``sun_path`` (108 bytes, with its NUL).
SOCKET_PATH_MAX = 107


@dataclass(frozen=True)
class ImexFiles:
    """Where one node's IMEX daemon keeps its files (all under ``directory`` but, when the
    state directory is too deep for a Unix socket, the command socket)."""

    directory: Path
    socket: Path

    @property
    def config(self) -> Path:
        return self.directory / "config.cfg"

    @property
    def nodes(self) -> Path:
        return self.directory / "nodes_config.cfg"

    @property
    def hosts(self) -> Path:
        """The daemon's ``/etc/hosts`` (bind-mounted there in its mount namespace)."""
        return self.directory / "hosts"

    @property
    def log(self) -> Path:
        return self.directory / "nvidia-imex.log"


def imex_files(directory: Path, short_dir: Path = Path("/tmp")) -> ImexFiles:
    """The files under ``directory``; the command socket beside them, or, where that path is
    too long for a Unix socket, in ``short_dir`` under a name derived from ``directory``."""
    socket = directory / "imex.sock"
    if len(str(socket)) > SOCKET_PATH_MAX:
        digest = hashlib.sha256(str(directory).encode()).hexdigest()[:16]
        socket = short_dir / f"gpu-agent-imex-{digest}.sock"
    return ImexFiles(directory=directory, socket=socket)


def render_config(files: ImexFiles, *, address: str, port: int) -> str:
    """The daemon's config file (``nvidia-imex -c``)."""
    lines = [
        "# Written by gpu-agent for this node's compute domain; rewritten on every change.",
        "DAEMONIZE=1",
        f"BIND_INTERFACE_IP={address}",
        f"SERVER_PORT={port}",
        f"IMEX_NODE_CONFIG_FILE={files.nodes}",
        "IMEX_CMD_ENABLED=1",
        f"IMEX_CMD_UNIX_DOMAIN_PATH={files.socket}",
        f"LOG_FILE_NAME={files.log}",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
    ]
    return "\n".join(lines) + "\n"


def seat_names(domain_id: str, size: int) -> tuple[str, ...]:
    """The IMEX node names of a domain of ``size`` seats, one per seat (pure):
    ``imex-<first 12 hex of sha256(domain id)>-<seat, 4 digits>``. Every member derives the
    same names; two domains get different ones, so daemons of two domains never take each
    other for peers."""
    digest = hashlib.sha256(domain_id.encode()).hexdigest()[:12]
    return tuple(f"imex-{digest}-{seat:04d}" for seat in range(size))


def render_nodes(names: Sequence[str]) -> str:
    """The node list: one seat name a line (a node's IMEX index is its seat)."""
    return "".join(f"{name}\n" for name in names)


def render_hosts(names: Sequence[str], peers: Sequence[str | None]) -> str:
    """The daemon's ``/etc/hosts``: localhost, then each held seat's name at its member's
    address (an empty seat has no line: its name does not resolve)."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
    lines += [f"{peer} {name}" for name, peer in zip(names, peers, strict=True)
              if peer is not None and address_key(peer) is not None]
    return "\n".join(lines) + "\n"


def address_key(value: str) -> str | None:
    """An IP address in one spelling (``fd00::05`` and ``fd00::5`` are one), or None when
    ``value`` is not one (pure)."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def peer_errors(peers: Sequence[str | None], address: str) -> list[dict[str, Any]]:
    """Why a domain's seats are refused, each a ``{"field", "reason"}`` (pure): 1 to
    :data:`MAX_PEERS` seats, each an IP address or null (an empty seat), no address twice,
    this node's address among them."""
    errors: list[dict[str, Any]] = []
    if not 1 <= len(peers) <= MAX_PEERS:
        errors.append({"field": "peers", "reason": f"1 to {MAX_PEERS} entries, not "
                       f"{len(peers)}"})
    seen: dict[str, int] = {}
    for position, peer in enumerate(peers):
        if peer is None:
            continue
        key = address_key(peer)
        if key is None:
            errors.append({"field": f"peers[{position}]", "reason": "not an IP address (the "
                           "agent maps each seat's IMEX name to it)"})
            continue
        if key in seen:
            errors.append({"field": f"peers[{position}]", "reason": f"same as "
                           f"peers[{seen[key]}]"})
        seen.setdefault(key, position)
    if peers and (address_key(address) or address) not in seen:
        errors.append({"field": "peers", "reason": f"does not include this node's IMEX "
                       f"address {address}"})
    return errors
