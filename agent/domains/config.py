"""The IMEX daemon's files for a domain, rendered from values (pure), and the checks of a
domain's peer list."""

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
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


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


def render_nodes(peers: Sequence[str]) -> str:
    """The node list: one address a line, in the domain's order (a node's index is its
    line)."""
    return "".join(f"{peer}\n" for peer in peers)


def is_host(value: str) -> bool:
    """An IP address or a DNS name (pure)."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    name = value.removesuffix(".")
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split(".")) \
        and not name.replace(".", "").isdigit()


def peer_errors(peers: Sequence[str], address: str) -> list[dict[str, Any]]:
    """Why a peer list is refused, each a ``{"field", "reason"}`` (pure): 1 to
    :data:`MAX_PEERS` entries, each an IP address or DNS name, none twice, this node's address
    among them."""
    errors: list[dict[str, Any]] = []
    if not 1 <= len(peers) <= MAX_PEERS:
        errors.append({"field": "peers", "reason": f"1 to {MAX_PEERS} entries, not "
                       f"{len(peers)}"})
    seen: dict[str, int] = {}
    for position, peer in enumerate(peers):
        if not is_host(peer):
            errors.append({"field": f"peers[{position}]", "reason": "not an IP address or "
                           "DNS name"})
        key = peer.lower()
        if key in seen:
            errors.append({"field": f"peers[{position}]", "reason": f"same as "
                           f"peers[{seen[key]}]"})
        seen.setdefault(key, position)
    if peers and address.lower() not in seen:
        errors.append({"field": "peers", "reason": f"does not include this node's IMEX "
                       f"address {address}"})
    return errors
