"""``gpu-agent topo``: the matrix as ``nvidia-smi topo -m`` prints it, best sets, slices."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agent.cli.client import AgentClient
from agent.device_names import ascii_integer
from agent.dra.resource_slices import KUBERNETES_VERSIONS
from agent.topology.matrix import render

#: The versions ``GET /v1/resourceslices?kubernetes=`` knows, so the two cannot drift.
KUBERNETES_CHOICES = tuple(f"{major}.{minor}" for major, minor in KUBERNETES_VERSIONS)


def add_parsers(sub: Any, client_opts: argparse.ArgumentParser) -> None:
    topo = sub.add_parser("topo", parents=[client_opts],
                          help="NVLink/PCIe topology matrix, as nvidia-smi topo -m prints it")
    verbs = topo.add_subparsers(dest="topo_verb")
    select = verbs.add_parser("select", parents=[client_opts],
                              help="the best-connected set of N GPUs")
    select.add_argument("count", type=int)
    select.add_argument("--must-include", nargs="+", default=[], metavar="GPU",
                        help="GPUs (index or UUID) the set must contain")
    select.add_argument("--candidates", nargs="+", metavar="GPU",
                        help="choose only among these GPUs")
    slices = verbs.add_parser("slices", parents=[client_opts],
                              help="this node's ResourceSlices (resource.k8s.io/v1, JSON)")
    slices.add_argument("--kubernetes", choices=KUBERNETES_CHOICES, default="1.35",
                        help="API server version, as the agent's API takes it (1.35 and "
                             "newer: counters and devices in separate slices)")


def _ref(text: str) -> int | str:
    index = ascii_integer(text)
    return text if index is None else index


def run(args: argparse.Namespace, client: AgentClient) -> int:
    verb = getattr(args, "topo_verb", None)
    if verb == "select":
        body: dict[str, Any] = {"count": args.count,
                                "must_include": [_ref(g) for g in args.must_include]}
        if args.candidates:
            body["candidates"] = [_ref(g) for g in args.candidates]
        answer = client.request("POST", "/v1/topology/select", body).body
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            print("GPUs: " + ", ".join(map(str, answer["gpus"])))
            print(answer["explanation"])
        return 0
    if verb == "slices":
        answer = client.request("GET", f"/v1/resourceslices?kubernetes={args.kubernetes}").body
        print(json.dumps(answer, indent=2))
        return 0
    topology = client.request("GET", "/v1/topology").body
    if args.json:
        print(json.dumps(topology, indent=2))
        return 0
    gpus = topology["gpus"]
    print(render(topology["matrix"], [g["cpu_affinity"] for g in gpus],
                 [g["numa_node"] for g in gpus]))
    if topology["islands"]:
        print("\nNVLink islands: " + "  ".join(
            "{" + ",".join(map(str, island)) + "}" for island in topology["islands"]))
    return 0
