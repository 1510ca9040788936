"""``gpu-agent domains [ID]``: the compute domain this node is in, its IMEX daemon and the
domain's seats (name, member address) as that daemon sees them."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from agent.cli import options
from agent.cli.client import AgentClient
from agent.cli.tables import key_values, table


def add_parsers(sub: Any) -> None:
    domains = sub.add_parser(
        "domains", parents=[options.OUTPUT],
        help="the compute domain this node is in (IMEX daemon, nodes), or one by id")
    domains.add_argument("domain", nargs="?", help="one domain, by id (default: every one)")


def domains_text(body: dict[str, Any], width: int | None = None) -> str:
    """``domains``: one line per domain (fits ``width``; every column with -o wide)."""
    rows = [[d["id"], d["state"], d["daemon"]["state"],
             "-" if d["daemon"]["pid"] is None else str(d["daemon"]["pid"]),
             f"{sum(n['status'] == 'READY' for n in d['nodes'])}/{len(d['peers'])}",
             str(len(d["holders"])), d["address"]] for d in body["domains"]]
    if not rows:
        return "No compute domain on this node."
    return table(["DOMAIN", "STATE", "DAEMON", "PID", "READY", "CLAIMS", "ADDRESS"], rows,
                 width)


def domain_text(domain: dict[str, Any], width: int | None = None) -> str:
    """``domains ID``: the domain as ``key  value`` lines, then its seats: each one's IMEX
    name, member address and status as this node's daemon sees it."""
    daemon = domain["daemon"]
    peers = domain["peers"]
    lines = key_values([
        ("domain", domain["id"]), ("state", domain["state"]),
        ("address", domain["address"]),
        ("daemon", daemon["state"] + ("" if daemon["pid"] is None else f" (pid {daemon['pid']})")),
        ("imex state", daemon["imex_state"] or "-"),
        *([("reason", daemon["reason"])] if daemon["reason"] else []),
        ("claims", ", ".join(domain["holders"]) or "-"),
        ("seats", f"{sum(p is not None for p in peers)}/{len(peers)} held")], width)
    status = {n["index"]: n["status"] for n in domain["nodes"]}
    names = domain.get("names") or [""] * len(peers)
    lines += ["", table(["SEAT", "NAME", "ADDRESS", "STATUS"],
                        [[str(seat), name, peer or "-", status.get(seat, "-")]
                         for seat, (name, peer) in enumerate(zip(names, peers, strict=False))],
                        width)]
    return "\n".join(lines)


def run(args: argparse.Namespace, client: AgentClient) -> int:
    if args.domain:
        body = client.request("GET", f"/v1/domains/{quote(args.domain, safe='')}").body
        options.emit(args, body, domain_text)
    else:
        options.emit(args, client.request("GET", "/v1/domains").body, domains_text)
    return 0
