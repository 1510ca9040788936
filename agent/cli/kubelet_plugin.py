"""``gpu-agent kubelet-plugin``: kubelet's DRA plugin for this node (agent/kubeplugin/)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """The ``kubelet-plugin`` subcommand and its flags."""
    plugin = sub.add_parser(
        "kubelet-plugin", help="run kubelet's DRA plugin for this node's agent",
        description="Serve kubelet's DRA plugin protocol (registration, NodePrepareResources, "
                    "NodeUnprepareResources) and publish this node's ResourceSlices, talking "
                    "to the agent only through its REST API. Needs the 'kubernetes' extra.")
    plugin.add_argument("--agent-socket", required=True, type=Path, metavar="PATH",
                        help="the agent's Unix socket, e.g. /run/gpu-agent/agent.sock")
    plugin.add_argument("--token-file", required=True, type=Path, metavar="PATH",
                        help="the agent token (claims scope) for the plugin, mode 0600: the "
                             "token alone or a 'name:token[:scopes]' line; re-read when it "
                             "changes")
    plugin.add_argument("--node-name", default=os.environ.get("NODE_NAME"), metavar="NAME",
                        help="this node's name, the pool name of its slices (default "
                             "$NODE_NAME)")
    plugin.add_argument("--driver", default="gpu.nodeagent.dev", metavar="NAME",
                        help="DRA driver name (default gpu.nodeagent.dev)")
    plugin.add_argument("--registry-dir", default=Path("/var/lib/kubelet/plugins_registry"),
                        type=Path, metavar="DIR",
                        help="kubelet's plugin registration directory: <driver>-reg.sock "
                             "goes here (default /var/lib/kubelet/plugins_registry)")
    plugin.add_argument("--plugins-dir", default=Path("/var/lib/kubelet/plugins"), type=Path,
                        metavar="DIR",
                        help="kubelet's plugins directory: <driver>/dra.sock goes here "
                             "(default /var/lib/kubelet/plugins)")
    plugin.add_argument("--kubeconfig", type=Path, metavar="PATH",
                        help="kubeconfig for the API server (default: in-cluster, from "
                             "$KUBERNETES_SERVICE_HOST, $KUBERNETES_SERVICE_PORT and the "
                             "pod's ServiceAccount token); a rewritten token is used without "
                             "a restart")
    plugin.add_argument("--health-listen", default="127.0.0.1:9478", metavar="HOST:PORT",
                        help="/healthz, /readyz and /metrics (default 127.0.0.1:9478)")
    plugin.add_argument("--agent-lost-after", type=float, default=60.0, metavar="SECONDS",
                        help="delete this node's slices once the agent has been unreachable "
                             "this long (default 60)")
    plugin.add_argument("--claim-read-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="fail a claim whose ResourceClaim the API server has not sent "
                             "within this long (kubelet retries it; default 10)")
    plugin.add_argument("--mig-config-map", metavar="NAMESPACE/NAME",
                        help="follow this Node's nvidia.com/mig.config label as mig-manager "
                             "does: apply that label of this ConfigMap's config.yaml through "
                             "the agent and report nvidia.com/mig.config.state (default off; "
                             "never alongside a running mig-manager; docs/mig.md)")
    plugin.add_argument("--mig-token-file", type=Path, metavar="PATH",
                        help="the agent token (geometry scope) for --mig-config-map, mode "
                             "0600, as --token-file")
    plugin.add_argument("--mig-allow-reset", action="store_true",
                        help="with --mig-config-map: let the agent reset a GPU whose MIG mode "
                             "change stays pending (Ampere; the agent's --gpu-reset-command)")
    plugin.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE"),
                        metavar="NAMESPACE",
                        help="take part in electing the one plugin of the cluster that gives "
                             "compute-domain claims no NVLink clique can hold a Warning Event "
                             "saying why (a Lease in this namespace; default $POD_NAMESPACE; "
                             "without one this plugin never explains)")
    plugin.add_argument("--domain-explain-interval", type=float, default=30.0,
                        metavar="SECONDS", help=argparse.SUPPRESS)
    plugin.add_argument("--lease-duration", type=float, default=60.0, metavar="SECONDS",
                        help=argparse.SUPPRESS)
    plugin.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text (key=value) or json, one line per event (default text)")
    plugin.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default="info", help="log verbosity (default info)")


def run(args: argparse.Namespace, wire: Any = None) -> int:
    """Run the plugin until SIGTERM; 2 when it cannot start. ``wire`` replaces
    ``process.wire_kubernetes`` (tests run the real process with fakes)."""
    from agent import logs  # noqa: PLC0415 - keeps the client verbs fast

    try:
        from agent.kubeplugin import process  # noqa: PLC0415 - grpcio is an optional extra
    except ImportError as err:
        print(f"gpu-agent kubelet-plugin: {err.name or err} is missing; install "
              "gpu-node-agent[kubernetes]", file=sys.stderr)
        return 2
    logs.configure(args.log_format, args.log_level)
    settings = process.PluginSettings(
        agent_socket=args.agent_socket, token_file=args.token_file,
        node_name=args.node_name or "", driver=args.driver, registry_dir=args.registry_dir,
        plugins_dir=args.plugins_dir, kubeconfig=args.kubeconfig,
        health_listen=args.health_listen, agent_lost_after_s=args.agent_lost_after,
        claim_read_timeout_s=args.claim_read_timeout,
        mig_config_map=args.mig_config_map, mig_token_file=args.mig_token_file,
        mig_allow_reset=args.mig_allow_reset, lease_namespace=args.lease_namespace or None,
        explain_interval_s=args.domain_explain_interval,
        lease_duration_s=args.lease_duration)
    try:
        return asyncio.run(process.serve(settings, wire or process.wire_kubernetes))
    except process.PluginStartError as err:
        # One line, whatever the cause's own text holds: it goes to a journal or a pod log.
        print(f"gpu-agent kubelet-plugin: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
