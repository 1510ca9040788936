"""``gpu-agent mps-host``: start MPS control daemons (and, with ``--imex``, the IMEX daemon)
for the agent, outside its cgroup (agent/mpshost/, docs/sharing.md)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """The ``mps-host`` subcommand and its flags."""
    host = sub.add_parser(
        "mps-host", help="start MPS control daemons for the agent, outside its cgroup",
        description="Serve the agent's requests to start 'nvidia-cuda-mps-control -d' on a "
                    "Unix socket. Run it as its own DaemonSet or systemd unit: the daemons "
                    "it starts live in its cgroup and outlive agent restarts. SIGTERM stops "
                    "it without stopping any daemon.")
    # Its own --help section: argparse lists a required flag among the optional ones.
    required = host.add_argument_group("required arguments")
    required.add_argument("--socket", required=True, type=Path, metavar="PATH",
                          help="the socket the agent's --mps-host-socket names")
    host.add_argument("--mps-root", type=Path, metavar="DIR",
                      help="the agent's --mps-root: pipe and log directories must be below it")
    host.add_argument("--mps-control", type=Path, metavar="PATH",
                      help="the nvidia-cuda-mps-control binary, the only one run")
    host.add_argument("--imex", type=Path, metavar="PATH",
                      help="the nvidia-imex binary, the only one run for the agent's IMEX "
                           "daemon (with --imex-root; it need not exist on a node without "
                           "NVLink domains; default: no IMEX daemon is run)")
    host.add_argument("--imex-root", type=Path, metavar="DIR",
                      help="the agent's IMEX directory (<state dir>/imex): the config and "
                           "hosts files of an IMEX start must be below it")
    host.add_argument("--private-shm", action="store_true",
                      help="give each daemon <dir of the pipe directory>/shm at /dev/shm, the "
                           "directory its clients get there (in the mount namespace of its "
                           "own every daemon gets)")
    host.add_argument("--socket-group", metavar="GROUP",
                      help="group that may use the socket (mode 0660), name or number "
                           "(default: none, mode 0600, root only)")
    host.add_argument("--selinux-context", metavar="CONTEXT",
                      help="label each daemon's pipe and shm directories with this SELinux "
                           "context before it starts, e.g. system_u:object_r:"
                           "container_file_t:s0 on OpenShift (default: leave labels alone)")
    host.add_argument("--max-connections", type=_positive, default=None, metavar="N",
                      help="connections open at once; over it the oldest one that has not "
                           "sent its request is answered busy and closed, or the new one "
                           "when none is waiting (default 64)")
    host.add_argument("--ping", action="store_true",
                      help="only ask the host on --socket whether it is ready (exit 0) or "
                           "not (exit 1): a probe")
    host.add_argument("--log-format", choices=("text", "json"), default="text",
                      help="text (key=value) or json, one line per event (default text)")
    host.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                      default="info", help="log verbosity (default info)")


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in 1..65536")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (0), or answer ``--ping``; 2 when it cannot start."""
    from agent import logs  # noqa: PLC0415 - keeps the client verbs fast
    from agent.errors import AgentError  # noqa: PLC0415
    from agent.mps.host_client import HostLauncher  # noqa: PLC0415
    from agent.mpshost.imex import ImexPolicy  # noqa: PLC0415
    from agent.mpshost.policy import LaunchPolicy  # noqa: PLC0415
    from agent.mpshost.server import MAX_CONNECTIONS, MpsHost, group_id  # noqa: PLC0415
    from agent.mpshost.server import run as serve  # noqa: PLC0415

    if args.ping:
        try:
            asyncio.run(HostLauncher(args.socket, connect_timeout_s=3.0).ping())
        except AgentError as err:
            print(f"gpu-agent mps-host: {err.detail}", file=sys.stderr)
            return 1
        return 0
    problems = [f"--{name} is required" for name, value in
                (("mps-root", args.mps_root), ("mps-control", args.mps_control)) if not value]
    if args.mps_control and not os.access(args.mps_control, os.X_OK):
        problems.append(f"--mps-control {args.mps_control} is not an executable file")
    # --imex is not required to exist: nodes without NVLink domains have no nvidia-imex, and
    # the host serves their MPS daemons all the same (an IMEX start there fails, saying why).
    if (args.imex is None) != (args.imex_root is None):
        problems.append("--imex and --imex-root go together")
    group = None
    if args.socket_group is not None:
        try:
            group = group_id(args.socket_group)
        except ValueError as err:
            problems.append(f"--socket-group: {err}")
    if problems:
        print(f"gpu-agent mps-host: {'; '.join(problems)}", file=sys.stderr)
        return 2
    logs.configure(args.log_format, args.log_level)
    policy = LaunchPolicy(
        mps_control=args.mps_control.absolute(), mps_root=args.mps_root.absolute(),
        private_shm=args.private_shm, library_path=os.environ.get("LD_LIBRARY_PATH") or None)
    host = MpsHost(policy, socket_path=args.socket.absolute(), socket_group=group,
                   selinux_context=args.selinux_context,
                   max_connections=args.max_connections or MAX_CONNECTIONS,
                   imex=ImexPolicy(
                       imex=args.imex.absolute() if args.imex else None,
                       imex_root=args.imex_root.absolute() if args.imex_root else None))
    try:
        return asyncio.run(serve(host))
    except AgentError as err:
        print(f"gpu-agent mps-host: {err.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
