"""The simulated ``nvidia-imex``'s two input files, parsed into values: the config file
(``KEY=VALUE`` lines, NVIDIA's key names and defaults) and the node config file it names
(one peer IP address or host name a line). Bad input is a :class:`ConfigError` whose text is
one line naming the file, the line and what is wrong."""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
from pathlib import Path

DEFAULT_CONFIG = Path("/etc/nvidia-imex/config.cfg")
DEFAULT_NODES = Path("/etc/nvidia-imex/nodes_config.cfg")
DEFAULT_LOG = Path("/var/log/nvidia-imex.log")
SERVER_PORT = 50000
CMD_PORT = 50005
#: Quorum modes: NONE (ready at once), RECOVERY (NVIDIA's default: wait only for importers
#: of an unclean shutdown, of which the simulator has none), FULL (wait for every node).
QUORUM_MODES = ("NONE", "RECOVERY", "FULL")
#: Log levels: 0 none, 1 fatal, 2 error, 3 warning, 4 info (NVIDIA: 3 is warning).
MAX_LOG_LEVEL = 4


class ConfigError(Exception):
    """A config or node config file the daemon refuses (one line)."""


@dataclasses.dataclass(frozen=True)
class ImexConfig:
    """What the daemon reads at start; a change needs a restart, as NVIDIA documents."""

    path: Path
    daemonize: bool = True
    bind_interface_ip: str = ""
    server_port: int = SERVER_PORT
    node_config_file: Path = DEFAULT_NODES
    wait_for_quorum: str = "RECOVERY"
    #: Seconds after a lost connection before clean-up (the peer shows D); 0: never.
    node_disconnected_grace_time_s: int = 0
    log_file_name: Path = DEFAULT_LOG
    log_level: int = MAX_LOG_LEVEL
    cmd_enabled: bool = False
    cmd_bind_interface_ip: str = ""
    cmd_port: int = CMD_PORT
    cmd_unix_domain_path: Path | None = None

    @property
    def cmd_host(self) -> str:
        """The command service's address: its own, else the server's (an assumption)."""
        return self.cmd_bind_interface_ip or self.bind_interface_ip or "127.0.0.1"


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return value == "1"


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise ValueError("must be a TCP port from 0 to 65535")
    return int(value)


def _ip(value: str) -> str:
    if value:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IPv4 or IPv6 address (or empty)") from None
    return value


def _quorum(value: str) -> str:
    if value not in QUORUM_MODES:
        raise ValueError(f"must be one of {', '.join(QUORUM_MODES)}")
    return value


def _seconds(value: str) -> int:
    if not value.isdigit():
        raise ValueError("must be a whole number of seconds")
    return int(value)


def _level(value: str) -> int:
    if not value.isdigit() or int(value) > MAX_LOG_LEVEL:
        raise ValueError(f"must be a level from 0 to {MAX_LOG_LEVEL}")
    return int(value)


def _path(value: str) -> Path:
    if not value:
        raise ValueError("must be a path")
    return Path(value)


#: Config key -> (field, parser). Other keys (SSL, GSSAPI, statistics) are accepted and
#: ignored: the simulator does not model them.
_KEYS = {
    "DAEMONIZE": ("daemonize", _flag),
    "BIND_INTERFACE_IP": ("bind_interface_ip", _ip),
    "SERVER_PORT": ("server_port", _port),
    "IMEX_NODE_CONFIG_FILE": ("node_config_file", _path),
    "IMEX_WAIT_FOR_QUORUM": ("wait_for_quorum", _quorum),
    "IMEX_NODE_DISCONNECTED_GRACE_TIME": ("node_disconnected_grace_time_s", _seconds),
    "LOG_FILE_NAME": ("log_file_name", _path),
    "LOG_LEVEL": ("log_level", _level),
    "IMEX_CMD_ENABLED": ("cmd_enabled", _flag),
    "IMEX_CMD_BIND_INTERFACE_IP": ("cmd_bind_interface_ip", _ip),
    "IMEX_CMD_PORT": ("cmd_port", _port),
    "IMEX_CMD_UNIX_DOMAIN_PATH": ("cmd_unix_domain_path", _path),
}


def _lines(path: Path) -> list[tuple[int, str]]:
    """The file's meaningful lines (number, text): comments and blank lines dropped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"{path}: cannot read: {reason}") from None
    out = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append((number, line))
    return out


def parse_config(path: Path) -> ImexConfig:
    """The config file at ``path`` (unset keys keep NVIDIA's defaults)."""
    values: dict[str, object] = {}
    for number, line in _lines(path):
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{path}:{number}: {line[:60]!r} is not KEY=VALUE")
        if key not in _KEYS:
            continue
        field, parse = _KEYS[key]
        try:
            values[field] = parse(value)
        except ValueError as err:
            raise ConfigError(f"{path}:{number}: {key}={value[:60]}: {err}") from None
    if "cmd_unix_domain_path" in values and values["cmd_unix_domain_path"] == Path(""):
        values.pop("cmd_unix_domain_path")
    return ImexConfig(path=path, **values)  # type: ignore[arg-type]


def parse_nodes(path: Path) -> tuple[str, ...]:
    """The node config file: each node's IP address or host name, in file order (a node's
    index is its position). Empty or duplicated entries are refused."""
    nodes: list[str] = []
    for number, line in _lines(path):
        if len(line.split()) != 1:
            raise ConfigError(f"{path}:{number}: {line[:60]!r} is not one IP address or "
                              "host name")
        if line in nodes:
            raise ConfigError(f"{path}:{number}: node {line!r} is listed twice")
        nodes.append(line)
    if not nodes:
        raise ConfigError(f"{path}: lists no nodes (one IP address or host name a line)")
    return tuple(nodes)


def nodes_key(nodes: tuple[str, ...]) -> str:
    """A digest of the node list: peers with different lists refuse each other."""
    return hashlib.sha256("\n".join(nodes).encode()).hexdigest()[:16]
