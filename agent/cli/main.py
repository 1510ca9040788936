"""``gpu-agent``: run the agent (``serve``) or talk to a running one."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any
from urllib.parse import quote

import agent
from agent.cli import (
    admin,
    claims,
    completion,
    domains,
    kubelet_plugin,
    mig,
    mps_host,
    options,
    topo,
)
from agent.cli.client import EXIT_CODES, AgentClient, ClientError, UsageError, discover, tls_context
from agent.cli.tables import gpu_detail, gpu_table, node_lines
from agent.errors import AgentError

Command = Callable[[argparse.Namespace, AgentClient], int]

#: ``gpu-agent --help``'s text: plain words (the module docstring is reST for the code's readers).
DESCRIPTION = ("Run the GPU node agent (serve), kubelet's DRA plugin (kubelet-plugin) or the MPS "
               "host (mps-host), print a shell completion script (completion), or talk to a "
               "running agent (every other verb). The connection flags (--url, --token-file, "
               "--cacert, --cert, --key) may go anywhere on the line; every verb that prints "
               "an answer takes -o table|wide|json|yaml.")


def _serve(args: argparse.Namespace) -> int:
    from agent import daemon, logs, systemd  # noqa: PLC0415 - keeps client verbs fast
    from agent.host import limit_malloc_arenas  # noqa: PLC0415
    from agent.settings import resolve  # noqa: PLC0415

    limit_malloc_arenas()

    try:
        settings = resolve({
            "simulate": args.simulate, "state_dir": args.state_dir, "cdi_dir": args.cdi_dir,
            "listen": args.listen, "token_file": args.token_file,
            "auth_read": True if args.auth_read else None, "log_format": args.log_format,
            "log_level": args.log_level, "proc_root": args.proc_root,
            "node_name": args.node_name, "config": args.config,
            "gpu_reset_command": args.gpu_reset_command,
            "reapply_mig": False if args.no_reapply_mig else None,
            "driver_root": args.driver_root, "claim_tombstone_s": args.claim_tombstone_s,
            "collect_interval": args.collect_interval, "metrics_listen": args.metrics_listen,
            "metrics_hostname_label": args.metrics_hostname_label,
            "driver_name": args.driver_name, "dynamic_mig": True if args.dynamic_mig else None,
            "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "tls_client_ca": args.tls_client_ca, "socket_group": args.socket_group,
            "run_dir": args.run_dir, "pod_resources_socket": args.pod_resources_socket,
            "mps_root": args.mps_root, "mps_control": args.mps_control,
            "nvidia_smi": args.nvidia_smi, "mps_host_socket": args.mps_host_socket,
            "gpu_shares": True if args.gpu_shares else None,
            "no_execute_taints": True if args.no_execute_taints else None,
            "sim_cluster_uuid": args.sim_cluster_uuid, "sim_clique_id": args.sim_clique_id,
            "imex_address": args.imex_address, "imex_port": args.imex_port,
            "imex_ready_timeout_s": args.imex_ready_timeout_s, "imex": args.imex,
            "imex_ctl": args.imex_ctl,
        })
        systemd.check_environment()  # Type=notify without systemd-python: refuse to start
        logs.configure(settings.log_format, settings.log_level)
        systemd.configure_journal(settings.log_level)  # journald fields under systemd
        return asyncio.run(daemon.serve(settings))
    except AgentError as err:
        print(f"gpu-agent: {err.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _node(args: argparse.Namespace, client: AgentClient) -> int:
    body = client.request("GET", "/v1/node").body
    options.emit(args, body, lambda node, width: "\n".join(node_lines(node, width)))
    return 0


def _gpus(args: argparse.Namespace, client: AgentClient) -> int:
    if args.gpu is not None:
        body = client.request("GET", f"/v1/gpus/{quote(args.gpu, safe='')}").body
        options.emit(args, body, gpu_detail)
    else:
        body = client.request("GET", "/v1/gpus").body
        options.emit(args, body, lambda listing, width: gpu_table(listing["gpus"], width))
    return 0


def _sim(args: argparse.Namespace, client: AgentClient) -> int:
    verb = args.sim_verb
    response: Any
    if verb == "show":
        response = client.request("GET", "/v1/sim").body
    elif verb == "process" and args.action == "add":
        response = client.request("POST", "/v1/sim/processes", {
            "device": args.device, "pid": args.pid, "used_memory_mib": args.memory_mib}).body
    elif verb == "process":
        client.request("DELETE", f"/v1/sim/processes/{args.pid}")
        response = {"removed": args.pid}
    elif verb == "fault" and args.action == "add":
        response = client.request("POST", "/v1/sim/faults", {
            "function": args.function, "error": args.error, "gpu": args.gpu,
            "skip": args.skip, "times": args.times}).body
    elif verb == "fault":
        client.request("DELETE", "/v1/sim/faults")
        response = {"faults": []}
    elif verb == "latency":
        table: dict[str, float] = {}
        for item in args.latencies:
            name, sep, seconds = item.partition("=")
            if not sep:
                raise UsageError(f"latency {item!r}: expected FUNCTION=SECONDS")
            try:
                table[name] = float(seconds)
            except ValueError as err:
                raise UsageError(f"latency {item!r}: {seconds!r} is not a number") from err
        response = client.request("PUT", "/v1/sim/latency", table).body["latencies"]
    elif verb == "xid":
        xid_body = {"gpu": args.gpu, "xid": args.xid,
                    **({"recovery_action": args.recovery_action} if args.recovery_action
                       else {})}
        client.request("POST", "/v1/sim/xid", xid_body)
        response = xid_body
    elif verb == "fabric":
        fabric_body = {"gpu": args.gpu, "condition": args.condition,
                       **({"status": args.status} if args.status else {})}
        client.request("POST", "/v1/sim/fabric", fabric_body)
        response = fabric_body
    elif verb == "reset":
        client.request("POST", "/v1/sim/reset", {"gpu": args.gpu})
        response = {"reset": args.gpu}
    else:
        client.request("POST", "/v1/sim/reload-driver")
        response = {"reloaded": True}
    options.emit(args, response)
    return 0


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the agent",
                           description="Run the agent. Every flag may also be given as "
                                       "GPU_AGENT_<FLAG> in the environment or in --config.")
    # The README's flag table is generated from these (serve_flag_table): say each default.
    serve.add_argument("--simulate", metavar="PRESET",
                       help="run on a simulated node: dgx-h100, dgx-a100, hgx-h200, "
                            "a100-pcie-bridged, l40s, dgx-a100-r535 (an older driver), "
                            "gb200-nvl72 (one tray of a rack) (default: the real NVML)")
    serve.add_argument("--sim-cluster-uuid", metavar="UUID",
                       help="with --simulate: the NVLink fabric cluster UUID the GPUs report; "
                            "agents given the same UUID and clique id form one NVLink domain "
                            "(default: the preset's, one rack for gb200-nvl72)")
    serve.add_argument("--sim-clique-id", metavar="N",
                       help="with --simulate: the NVLink fabric clique id the GPUs report "
                            "(default: the preset's, 1 for gb200-nvl72)")
    serve.add_argument("--state-dir", metavar="DIR",
                       help="state directory, one agent each (a lock) (default "
                            "/var/lib/gpu-agent; ./.gpu-agent-sim with --simulate)")
    serve.add_argument("--cdi-dir", metavar="DIR",
                       help="where CDI specs are written (default /var/run/cdi; "
                            "<state-dir>/cdi with --simulate)")
    serve.add_argument("--listen", action="append", metavar="ADDR",
                       help="HOST:PORT (port 0 picks one) or unix:PATH; repeatable; bound "
                            "addresses go to <state-dir>/listeners.json (default "
                            "unix:/run/gpu-agent/agent.sock and 127.0.0.1:9401; with "
                            "--simulate the socket is <state-dir>/agent.sock)")
    serve.add_argument("--token-file", metavar="FILE",
                       help="bearer tokens, one 'name:token[:scope,...]' a line; scopes read, "
                            "claims, geometry, admin (none listed: all) (default: none; a "
                            "simulated agent writes <state-dir>/tokens)")
    serve.add_argument("--auth-read", action="store_true",
                       help="/v1/* reads need a token too (default: off)")
    serve.add_argument("--log-format", choices=("text", "json"),
                       help="text (key=value) or json, one line per event (default text)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                       help="debug adds a line per read request (default info)")
    serve.add_argument("--proc-root", metavar="DIR",
                       help="where /proc is (default /proc; the simulator writes its own)")
    serve.add_argument("--node-name", metavar="NAME",
                       help="node name (default $NODE_NAME or the hostname)")
    serve.add_argument("--gpu-reset-command", metavar="CMD",
                       help="command that resets one idle GPU, run only when a request allows "
                            "it, e.g. 'nvidia-smi -r -i {pci_bus_id}' ({uuid}, {index} too) "
                            "(default: none, the agent never resets a GPU)")
    serve.add_argument("--no-reapply-mig", action="store_true",
                       help="do not re-apply the last MIG geometry after a reboot or driver "
                            "reload (default: re-apply)")
    serve.add_argument("--driver-root", metavar="DIR",
                       help="where the host's NVIDIA driver files are: the claims' CDI specs "
                            "then bind-mount its libraries (default: none)")
    serve.add_argument("--run-dir", metavar="DIR",
                       help="per-boot marker outside the state directory: a deleted "
                            "checkpoint with claims on this boot freezes claims (default "
                            "/run/gpu-agent; .<state-dir>.run beside it with --simulate)")
    serve.add_argument("--claim-tombstone-s", type=float, metavar="SECONDS",
                       help="refuse a prepare this long after the same claim was unprepared "
                            "(default 600)")
    serve.add_argument("--collect-interval", type=float, metavar="SECONDS",
                       help="seconds between metrics collections, fractions allowed (default 5)")
    serve.add_argument("--metrics-listen", metavar="ADDR",
                       help="also serve /metrics, /healthz and /readyz here, without tokens "
                            "(HOST:PORT, deployments 0.0.0.0:9400, or unix:PATH) (default: "
                            "none)")
    serve.add_argument("--metrics-hostname-label", choices=("Hostname", "hostname"),
                       help="spelling of the host label on DCGM series: hostname for "
                            "dcgm-exporter 4.8.3+ dashboards (default Hostname, as "
                            "dcgm-exporter up to 4.8.2)")
    serve.add_argument("--pod-resources-socket", nargs="?", metavar="PATH",
                       const="/var/lib/kubelet/pod-resources/kubelet.sock",
                       help="label DCGM series with the pod, namespace and container holding "
                            "each device, from kubelet's PodResources API on this socket "
                            "(alone: /var/lib/kubelet/pod-resources/kubelet.sock; needs the "
                            "kubernetes extra) (default: off)")
    serve.add_argument("--driver-name", metavar="NAME",
                       help="DRA driver name of the ResourceSlices (default gpu.nodeagent.dev)")
    serve.add_argument("--dynamic-mig", action="store_true",
                       help="publish MIG as partitionable devices: every profile and "
                            "placement, with shared counters per GPU (default: off)")
    serve.add_argument("--gpu-shares", action="store_true",
                       help="publish full GPUs as shareable devices with a memory capacity "
                            "(DRA consumable capacity), each share enforced with MPS; not with "
                            "--dynamic-mig (default: off)")
    serve.add_argument("--no-execute-taints", action="store_true",
                       help="taint a lost GPU (and a reboot-class fault) NoExecute, so "
                            "Kubernetes evicts the pods using it (default: NoSchedule, running "
                            "pods stay)")
    serve.add_argument("--mps-root", metavar="DIR",
                       help="where MPS daemons' pipe, log and shm directories go; keep it "
                            "short (default <run-dir>/mps)")
    serve.add_argument("--mps-control", metavar="PATH",
                       help="the nvidia-cuda-mps-control binary (default <driver-root>/usr/bin/"
                            "nvidia-cuda-mps-control; the simulator's with --simulate)")
    serve.add_argument("--imex-address", metavar="IP",
                       help="this node's IMEX address: the IP its IMEX daemon binds to, as "
                            "compute domains' peer lists name it (default: none, compute "
                            "domains refused with 409 imex-not-configured)")
    serve.add_argument("--imex-port", metavar="PORT",
                       help="the IMEX daemons' peer port, the same on every node of a domain "
                            "(default 50000)")
    serve.add_argument("--imex-ready-timeout-s", metavar="SECONDS",
                       help="how long a prepare of an IMEX channel waits for this node's IMEX "
                            "daemon to be READY before it fails (default 30)")
    serve.add_argument("--imex", metavar="PATH",
                       help="the nvidia-imex binary (default <driver-root>/usr/bin/nvidia-imex; "
                            "the simulator's with --simulate)")
    serve.add_argument("--imex-ctl", metavar="PATH",
                       help="the nvidia-imex-ctl binary (default <driver-root>/usr/bin/"
                            "nvidia-imex-ctl; the simulator's with --simulate)")
    serve.add_argument("--nvidia-smi", metavar="PATH",
                       help="the nvidia-smi binary, for compute mode and time slices (default "
                            "<driver-root>/usr/bin/nvidia-smi; the simulator's with --simulate)")
    serve.add_argument("--mps-host-socket", metavar="PATH",
                       help="start MPS daemons through 'gpu-agent mps-host' on this socket, so "
                            "they outlive agent restarts (default: none, the agent starts them "
                            "itself: development only)")
    serve.add_argument("--tls-cert", metavar="PEM",
                       help="serve the API's TCP listeners over TLS with this certificate "
                            "chain (default: none, plain HTTP)")
    serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve.add_argument("--tls-client-ca", metavar="PEM",
                       help="require client certificates signed by this CA on the TCP "
                            "listeners, with --tls-cert (default: none)")
    serve.add_argument("--socket-group", metavar="GROUP",
                       help="group owning the API's Unix socket (mode 0660), name or number "
                            "(default: the agent's own)")
    serve.add_argument("--config", metavar="FILE",
                       help="TOML file with any of these settings, keys as the flag names "
                            "(default: none)")


def serve_flag_table() -> str:
    """The README's table of ``gpu-agent serve`` flags, generated from the parser so that the
    two cannot drift (``tests/cli/test_readme_flags.py`` compares them)."""
    sub = argparse.ArgumentParser().add_subparsers()
    _add_serve(sub)
    serve = sub.choices["serve"]
    rows = ["| flag | what (default) |", "|---|---|"]
    for action in serve._actions:  # argparse keeps its options only here
        if not action.option_strings or action.help == argparse.SUPPRESS \
                or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        if action.nargs != 0:
            value = ("{" + ",".join(action.choices) + "}" if action.choices
                     else action.metavar or action.dest.upper())
            flag = f"{flag} {value}"
        text = (action.help or "").replace("|", "\\|").replace("*", "\\*")
        text = text.replace("<", "&lt;").replace(">", "&gt;")  # not HTML tags to a renderer
        rows.append(f"| `{flag}` | {text} |")
    return "\n".join(rows)


def _add_sim(sub: Any) -> None:
    out = [options.OUTPUT]  # every sim verb prints JSON, or YAML with -o yaml
    sim = sub.add_parser("sim", parents=out, help="control a simulated agent")
    verbs = sim.add_subparsers(dest="sim_verb", required=True)
    verbs.add_parser("show", parents=out,
                     help="presets, processes, faults, latencies, call counters")
    process = verbs.add_parser("process", parents=out, help="attach or end a fake GPU process")
    actions = process.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", parents=out)
    add.add_argument("device", help="GPU or MIG device: UUID, GPU index or <gpu>:<mig>")
    add.add_argument("--pid", type=int)
    add.add_argument("--memory-mib", type=int)
    remove = actions.add_parser("rm", parents=out)
    remove.add_argument("pid", type=int)
    fault = verbs.add_parser("fault", parents=out, help="make NVML calls fail")
    actions = fault.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", parents=out)
    add.add_argument("function",
                     help="NVML function, e.g. nvmlDeviceCreateGpuInstanceWithPlacement")
    add.add_argument("error", help="NVML_ERROR_* name, or CRASH")
    add.add_argument("--gpu", help="only calls on this GPU (index or UUID)")
    add.add_argument("--skip", type=int, default=0, help="let this many matching calls pass")
    add.add_argument("--times", type=int, default=1, help="fail this many calls")
    actions.add_parser("clear", parents=out)
    latency = verbs.add_parser("latency", parents=out, help="seconds added to NVML calls")
    latency.add_argument("latencies", nargs="*", metavar="FUNCTION=SECONDS")
    xid = verbs.add_parser("xid", parents=out, help="raise an XID event")
    xid.add_argument("gpu", help="GPU or MIG device: UUID, GPU index or <gpu>:<mig>")
    xid.add_argument("xid", type=int)
    xid.add_argument("--recovery-action",
                     choices=("none", "reset", "reboot", "drain-p2p", "drain-and-reset"),
                     help="the GPU's NVML recovery action after it (default: what the "
                          "simulated driver sets for this XID)")
    fabric = verbs.add_parser("fabric", parents=out,
                              help="set what a GPU's NVLink fabric reports")
    fabric.add_argument("gpu", help="GPU index or UUID")
    fabric.add_argument("condition",
                        choices=("completed", "not-started", "in-progress", "failed", "degraded"))
    fabric.add_argument("--status", help="failed only: the NVML error it reports (default "
                                         "NVML_ERROR_INSUFFICIENT_RESOURCES)")
    reset = verbs.add_parser("reset", parents=out, help="reset a GPU as nvidia-smi -r does")
    reset.add_argument("gpu", help="GPU index or UUID")
    verbs.add_parser("reload-driver", parents=out, help="reload the simulated driver")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gpu-agent", description=DESCRIPTION, epilog=EXIT_CODES)
    top.add_argument("--version", action="version", version=f"gpu-agent {agent.__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    kubelet_plugin.add_parser(sub)
    mps_host.add_parser(sub)
    sub.add_parser("node", parents=[options.OUTPUT], help="node identity and versions")
    gpus = sub.add_parser("gpus", parents=[options.OUTPUT],
                          help="the node's GPUs (fits 120 columns; -o wide: every column), "
                               "or one of them")
    gpus.add_argument("gpu", nargs="?", help="one GPU, by index or UUID (default: every GPU)")
    _add_sim(sub)
    mig.add_parsers(sub)
    claims.add_parsers(sub)
    topo.add_parsers(sub)
    domains.add_parsers(sub)
    admin.add_parsers(sub)
    completion.add_parser(sub)
    _share_connection(top, seen=set(), skip=OWN_FLAGS)
    return top


#: The verbs that talk to no agent, with flags of their own.
OWN_FLAGS = frozenset({"serve", "kubelet-plugin", "mps-host", "completion"})


def _share_connection(node: argparse.ArgumentParser, seen: set[int],
                      skip: Collection[str] = ()) -> None:
    """Give ``node`` and every client verb and subverb under it the connection flags of
    :data:`options.CONNECTION` (defaults suppressed, so one given before the verb survives the
    subparsers after it). The servers' own parsers (``skip``) keep their flags."""
    if id(node) in seen:
        return  # an alias names the same parser twice
    seen.add(id(node))
    if "--url" not in node._option_string_actions:
        node._add_container_actions(options.CONNECTION)  # what parents=[...] does
    for action in node._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if name not in skip:
                    _share_connection(child, seen)


COMMANDS: dict[str, Command] = {"node": _node, "gpus": _gpus, "sim": _sim, "mig": mig.run,
                                "transitions": mig.run, "claims": claims.run, "cdi": claims.run,
                                "topo": topo.run, "domains": domains.run, **admin.COMMANDS}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's final flush
        return code
    except BrokenPipeError:
        # The reader went away (``gpu-agent gpus | head``): not an error worth a traceback.
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it
    except KeyboardInterrupt:
        # Ctrl-C while a verb waits on the agent: the user's own stop, not a crash to show.
        return 130  # 128 + SIGINT, as a shell reports it


def _main(argv: Sequence[str] | None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.command == "completion":
        return completion.run(args, top)
    if args.command == "serve":
        return _serve(args)
    if args.command == "kubelet-plugin":
        return kubelet_plugin.run(args)
    if args.command == "mps-host":
        return mps_host.run(args)
    if args.command == "cdi" and args.cdi_verb == "generate":
        return claims.generate(args)  # offline: opens NVML itself, talks to no agent
    try:
        conn = options.connection(args)
        url, token = discover(conn["url"], conn["token_file"])
        tls = tls_context(conn["cacert"], conn["cert"], conn["key"])
        return COMMANDS[args.command](args, AgentClient(url, token, tls=tls))
    except ClientError as err:
        print(f"gpu-agent: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
