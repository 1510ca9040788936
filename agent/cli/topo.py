"""``gpu-agent topo``: the matrix as ``nvidia-smi topo -m`` prints it, best sets, slices."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agent.cli.client import AgentClient
from agent.device_names import ascii_integer
from agent.topology.matrix import render


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
    slices.add_argument("--kubernetes", choices=("1.34", "1.35"), default="1.35",
                        help="API server version (1.35: counters and devices in separate "
                             "slices)")


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
