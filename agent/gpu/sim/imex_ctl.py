"""A simulated ``nvidia-imex-ctl``: queries a running simulated ``nvidia-imex``'s command
service, as NVIDIA's IMEX guide documents the tool.

- Where: ``-c <config>`` (default ``/etc/nvidia-imex/config.cfg``: its
  ``IMEX_CMD_UNIX_DOMAIN_PATH``, else ``IMEX_CMD_BIND_INTERFACE_IP``/``BIND_INTERFACE_IP``
  and ``IMEX_CMD_PORT``), ``-i <ip> <port>`` or ``-u <socket>``.
- ``-q``: the local daemon's state (``READY``, ``WAITING_FOR_PEERS``, ...); exit 0. No
  daemon answering: ``UNAVAILABLE`` and exit 1 (assumed).
- ``-N``: every node's state and the connectivity table as the local daemon sees it, and
  the domain state (``UP``, ``DEGRADED``, ``DOWN``); ``-j`` for JSON.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

from agent.gpu.sim import wire
from agent.gpu.sim.imex_config import DEFAULT_CONFIG, ConfigError, parse_config

USAGE = ("Usage: nvidia-imex-ctl [-i <IP> <PORT>|-u <socket path>|-c <config path>] "
         "<-N|-q> [-j] [-H]")
TIMEOUT_S = 5.0
LEGEND = ("Links: C connected, N never connected, R lost (clean-up pending), "
          "D lost and cleaned up, M node map mismatch, - no status")


class Usage(Exception):
    """Arguments the tool refuses."""


def _parse(args: list[str]) -> tuple[tuple[str, Any], str, bool]:
    where: tuple[str, Any] | None = None
    command: str | None = None
    as_json = False
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in ("-c", "-u") and rest:
            where = (arg, rest.pop(0)) if where is None else _twice()
        elif arg == "-i" and len(rest) >= 2:
            where = ("-i", (rest.pop(0), rest.pop(0))) if where is None else _twice()
        elif arg in ("-q", "-N") and command is None:
            command = arg[1]
        elif arg == "-j":
            as_json = True
        elif arg == "-H":
            continue
        else:
            raise Usage(f"unexpected argument {arg!r}")
    if command is None:
        raise Usage("one of -q or -N is required")
    return where or ("-c", str(DEFAULT_CONFIG)), command, as_json


def _twice() -> Any:
    raise Usage("only one of -i, -u or -c can be given")


def _connect(where: tuple[str, Any]) -> socket.socket:
    kind, value = where
    if kind == "-u":
        return wire.connect(Path(value), timeout_s=TIMEOUT_S)
    if kind == "-i":
        host, port = value
        if not str(port).isdigit():
            raise Usage(f"port {port!r} is not a number")
        return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    config = parse_config(Path(value))
    if not config.cmd_enabled:
        raise OSError(f"IMEX_CMD_ENABLED is not 1 in {value}")
    if config.cmd_unix_domain_path is not None:
        return wire.connect(config.cmd_unix_domain_path, timeout_s=TIMEOUT_S)
    return socket.create_connection((config.cmd_host, config.cmd_port), timeout=TIMEOUT_S)


def _ask(where: tuple[str, Any], command: str) -> dict[str, Any]:
    with _connect(where) as sock:
        wire.send(sock, {"command": command})
        reply = json.loads(sock.makefile("rb").readline() or b"null")
    if not isinstance(reply, dict) or "error" in reply:
        raise ValueError(f"unexpected reply {reply!r}")
    return reply


def _table(domain: dict[str, Any]) -> str:
    nodes = domain["nodes"]
    lines = [f"Node #{n['index']} - {n['host']} - {n['status']} - Version: "
             f"{n['version'] or '-'}" for n in nodes]
    lines += ["", LEGEND, "Nodes From\\To " + " ".join(f"{n['index']:>3}" for n in nodes)]
    for row in nodes:
        links = row["connections"]
        cells = " ".join(f"{links.get(col['host'], '-'):>3}" for col in nodes)
        lines.append(f"{row['index']:>13} {cells}")
    lines += ["", f"Domain State: {domain['status']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        where, command, as_json = _parse(args)
    except Usage as err:
        print(f"nvidia-imex-ctl: {err}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        reply = _ask(where, command)
    except ConfigError as err:
        print(f"nvidia-imex-ctl: {err}", file=sys.stderr)
        return 1
    except Usage as err:
        print(f"nvidia-imex-ctl: {err}\n{USAGE}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        if command == "q":
            print("UNAVAILABLE")
        print(f"nvidia-imex-ctl: cannot reach the IMEX command service: "
              f"{getattr(err, 'strerror', None) or err}", file=sys.stderr)
        return 1
    if command == "q":
        print(reply.get("state"))
    elif as_json:
        print(json.dumps(reply))
    else:
        print(_table(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
