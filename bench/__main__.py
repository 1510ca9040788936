"""Run the benchmarks and print their tables (``make bench``); ``--only NAME`` runs one."""

from __future__ import annotations

import argparse

from bench import (
    claim_cost,
    claims,
    compute_domains,
    dra,
    load,
    metrics_scrape,
    mig_disruption,
    mig_transition,
    packing,
    sharing,
    startup,
    topology_select,
)

BENCHMARKS = ("startup", "mig-disruption", "mig-transition", "topology-select", "metrics-scrape",
              "claims", "packing", "load", "dra", "sharing", "claim-cost", "compute-domains")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--only", choices=BENCHMARKS, help="run this benchmark alone")
    parser.add_argument("--runs", type=int, default=5, help="agent starts per preset (startup)")
    parser.add_argument("--pairs", type=int, default=mig_disruption.DEFAULT_PAIRS,
                        help="(current, desired) pairs per preset (mig-disruption)")
    parser.add_argument("--seed", type=int, default=mig_disruption.DEFAULT_SEED,
                        help="RNG seed of the pairs (mig-disruption)")
    args = parser.parse_args()
    if args.only in (None, "startup"):
        startup.main(runs=args.runs)
    if args.only is None:
        print()
    if args.only in (None, "mig-disruption"):
        mig_disruption.main(pairs=args.pairs, seed=args.seed)
    if args.only is None:
        print()
    if args.only in (None, "mig-transition"):
        mig_transition.main()
    if args.only is None:
        print()
    if args.only in (None, "topology-select"):
        topology_select.main()
    if args.only is None:
        print()
    if args.only in (None, "metrics-scrape"):
        metrics_scrape.main()
    if args.only is None:
        print()
    if args.only in (None, "claims"):
        claims.main()
    if args.only is None:
        print()
    if args.only in (None, "packing"):
        packing.main()
    if args.only is None:
        print()
    if args.only in (None, "load"):
        load.main([])
    if args.only is None:
        print()
    if args.only in (None, "dra"):
        dra.main()
    if args.only is None:
        print()
    if args.only in (None, "sharing"):
        sharing.main()
    if args.only is None:
        print()
    if args.only in (None, "claim-cost"):
        claim_cost.main(["--baseline", "HEAD"])  # this tree beside its last commit
    if args.only is None:
        print()
    if args.only in (None, "compute-domains"):
        compute_domains.main([])


if __name__ == "__main__":
    main()
