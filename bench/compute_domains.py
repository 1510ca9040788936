"""Compute domains at rack scale: how long a domain job takes to start, and how many API
writes it costs, on the 18 + 2 node bed of tests/k8s/domain_bed.py (simulated GB200 NVL72
nodes, each a real agent with simulated IMEX, a real kubelet plugin and kubelet's DRA
manager; a real kube-apiserver and kube-scheduler).

For each domain size (16 and 18 nodes of the first clique) one job is created: one domain
claim shared by the job's pods, one pod a node with the node's four GPUs. Measured from the
creation of the job's objects: until the scheduler bound every pod, and until every pod's
claims were prepared through kubelet's DRA manager (every member's IMEX started with the
whole node list and READY). Then the API server's write requests during that time, by
resource (its own ``apiserver_request_total``), and the plugins' writes of their own Nodes for
membership: what NVIDIA's driver writes into one ComputeDomain status per node, growing with
the domain and contended by all, is here two patches of each node's own object. Every job is
checked as the tests check it (one clique; every member with exactly the job's nodes, UP),
then unprepared and released before the next. Last, a job of every node of the bed (more than
any clique has) must stay Pending; the scheduler's message and the claim's Event are printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests.k8s.domain_bed import BedSize, DomainBed, imex_seats, nodes_of, start_bed
from tests.k8s.scheduling import unschedulable
from tests.waiting import wait_for

RACK = BedSize(first=18, second=2)
SIZES = (16, 18)
WRITES = "gpu_agent_plugin_domain_node_writes_total"


@dataclass(frozen=True)
class Run:
    nodes: int
    scheduled_s: float
    prepared_s: float
    up_s: float
    writes: Counter[str]
    node_writes: dict[str, float]
    """Per member: its plugin's patches of its own Node (join and state)."""


def run_one(bed: DomainBed, nodes: int) -> Run:
    before = bed.api_writes()
    before_nodes = {n: s.plugin.metric(WRITES, what="join") + s.plugin.metric(WRITES, what="state")
                    for n, s in bed.stacks.items()}
    started = time.monotonic()
    job = bed.submit(f"domain-{nodes}", nodes, name=f"job{nodes}")
    where = wait_for(lambda: (found := bed.bound(job)) and len(found) == nodes and found,
                     f"{nodes} pods bound", 120)
    scheduled = time.monotonic() - started
    answers = bed.prepare_all(job, where, within_s=300)
    prepared = time.monotonic() - started
    failed = {pod: a for pod, a in answers.items() if not a.get("ok")}
    assert not failed, failed
    members = nodes_of(where)
    want = sorted(bed.addresses[n] for n in members)

    def up() -> bool:
        views = [bed.domain_view(n, job.uid) for n in members]
        return all(v is not None and sorted(p for p in v["peers"] if p) == want
                   and v["state"] == "UP" for v in views)

    wait_for(up, "the domain UP on every member", 120)
    up_s = time.monotonic() - started
    writes = bed.api_writes() - before
    # Lease renewals (the scheduler's, the domain explainer's) are the cluster's, a few a
    # minute whatever the domains.
    writes.pop("leases", None)
    assert len({bed.cliques[n] for n in members}) == 1, where
    for node in members:
        pid = bed.domain_view(node, job.uid)["daemon"]["pid"]  # type: ignore[index]
        assert sorted(a for a in imex_seats(bed.stacks[node], pid) if a) == want
    node_writes = {n: bed.stacks[n].plugin.metric(WRITES, what="join")
                   + bed.stacks[n].plugin.metric(WRITES, what="state") - before_nodes[n]
                   for n in members}
    for pod, answer in bed.unprepare_all(job, where).items():
        assert answer.get("ok"), (pod, answer)
    bed.release(job)
    return Run(nodes, scheduled, prepared, up_s, writes, node_writes)


def too_big(bed: DomainBed, nodes: int) -> str:
    """A job of every node of the bed (more than any clique has) stays Pending: the
    scheduler's message on its first pod (its pods bound: none, checked) and the Event the
    explaining plugin gave its claim."""
    job = bed.submit(f"domain-{nodes}", nodes, name=f"job{nodes}")
    message = wait_for(lambda: unschedulable(bed.server, job.namespace, job.pods[0]),
                       f"the {nodes}-node job unschedulable", 120)
    event = wait_for(lambda: bed.unfit_event(job), "the claim's ComputeDomainUnfit Event", 120)
    assert bed.bound(job) == {}, bed.bound(job)
    return f"{nodes}-node job: Pending, {message}\nits claim: {event['reason']}: " \
           f"{event['message']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compute_domains")
    parser.add_argument("--first", type=int, default=RACK.first)
    parser.add_argument("--second", type=int, default=RACK.second)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    size = BedSize(args.first, args.second)
    print(f"# Compute domains: {size.first} + {size.second} simulated GB200 NVL72 nodes "
          f"(agent, IMEX, plugin, kubelet DRA manager each), kube-scheduler 1.37; "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-domains-") as root:
        bed_start = time.monotonic()
        beds = start_bed(Path(root), size)
        bed = next(beds)
        print(f"bed start: {time.monotonic() - bed_start:.1f} s")
        try:
            runs = [run_one(bed, n) for n in args.sizes]
            pending = too_big(bed, size.first + size.second)
        finally:
            next(beds, None)
    print(f"{'nodes':>5}{'bound s':>9}{'prepared s':>12}{'UP s':>7}{'API writes':>12}"
          f"{'per node':>10}{'Node patches/member':>21}  writes by resource")
    for r in runs:
        total = sum(r.writes.values())
        patches = sorted(set(r.node_writes.values()))
        shown = ", ".join(f"{k} {v}" for k, v in r.writes.most_common())
        print(f"{r.nodes:>5}{r.scheduled_s:>9.1f}{r.prepared_s:>12.1f}{r.up_s:>7.1f}{total:>12}"
              f"{total / r.nodes:>10.1f}{'/'.join(f'{p:g}' for p in patches):>21}  {shown}")
    print(pending)


if __name__ == "__main__":
    main()
