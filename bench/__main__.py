"""Run every benchmark and print its table (``make bench``)."""

from __future__ import annotations

import argparse

from bench import startup


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--runs", type=int, default=5, help="agent starts per preset")
    args = parser.parse_args()
    startup.main(runs=args.runs)


if __name__ == "__main__":
    main()
