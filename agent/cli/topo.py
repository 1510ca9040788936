"""``gpu-agent topo``: the matrix as ``nvidia-smi topo -m`` prints it, best sets, slices."""

from __future__ import annotations

import argparse
from typing import Any

from agent.cli import options
from agent.cli.client import AgentClient
from agent.device_names import ascii_integer
from agent.dra.resource_slices import KUBERNETES_VERSIONS
from agent.topology.matrix import render

#: The versions ``GET /v1/resourceslices?kubernetes=`` knows, so the two cannot drift.
KUBERNETES_CHOICES = tuple(f"{major}.{minor}" for major, minor in KUBERNETES_VERSIONS)


def add_parsers(sub: Any) -> None:
    out = [options.OUTPUT]
    topo = sub.add_parser("topo", parents=out,
                          help="NVLink/PCIe topology matrix, as nvidia-smi topo -m prints it")
    verbs = topo.add_subparsers(dest="topo_verb")
    select = verbs.add_parser("select", parents=out,
                              help="the best-connected set of N GPUs")
    select.add_argument("count", type=int)
    select.add_argument("--must-include", nargs="+", default=[], metavar="GPU",
                        help="GPUs (index or UUID) the set must contain")
    select.add_argument("--candidates", nargs="+", metavar="GPU",
                        help="choose only among these GPUs")
    slices = verbs.add_parser("slices", parents=out,
                              help="this node's ResourceSlices (resource.k8s.io/v1; JSON, or "
                                   "-o yaml)")
    slices.add_argument("--kubernetes", choices=KUBERNETES_CHOICES, default="1.35",
                        help="API server version, as the agent's API takes it (1.35 and "
                             "newer: counters and devices in separate slices)")


def _ref(text: str) -> int | str:
    index = ascii_integer(text)
    return text if index is None else index


def matrix_text(topology: dict[str, Any], _width: int | None = None) -> str:
    """``topo``: the matrix as ``nvidia-smi topo -m`` prints it (never cut: a cut matrix
    misleads), then the NVLink islands."""
    gpus = topology["gpus"]
    text = render(topology["matrix"], [g["cpu_affinity"] for g in gpus],
                  [g["numa_node"] for g in gpus])
    if topology["islands"]:
        text += "\n\nNVLink islands: " + "  ".join(
            "{" + ",".join(map(str, island)) + "}" for island in topology["islands"])
    return text


def selection_text(answer: dict[str, Any], width: int | None = None) -> str:
    """``topo select``: the GPUs chosen, then why."""
    return "GPUs: " + ", ".join(map(str, answer["gpus"])) + f"\n{answer['explanation']}"


def run(args: argparse.Namespace, client: AgentClient) -> int:
    verb = getattr(args, "topo_verb", None)
    if verb == "select":
        body: dict[str, Any] = {"count": args.count,
                                "must_include": [_ref(g) for g in args.must_include]}
        if args.candidates:
            body["candidates"] = [_ref(g) for g in args.candidates]
        options.emit(args, client.request("POST", "/v1/topology/select", body).body,
                     selection_text)
    elif verb == "slices":
        answer = client.request("GET", f"/v1/resourceslices?kubernetes={args.kubernetes}").body
        options.emit(args, answer)  # Kubernetes objects: JSON (or YAML), no table
    else:
        options.emit(args, client.request("GET", "/v1/topology").body, matrix_text)
    return 0
