"""Side by side against a baseline revision: ``python -m bench.compare --baseline REV``.

Checks REV out into a temporary git worktree, then, round by round, runs each measurement
(claims prepare/unprepare, MIG transition overhead, metrics scrape) once on the baseline and
once on this tree, each in its own subprocess with ``PYTHONPATH`` set to the tree measured (the
agent processes a bench starts inherit it, so each tree runs its own agent). The order swaps
every round (baseline first, then current first, ...), so slow drifts of a shared machine and
any first-run advantage hit both alike. Every figure is lower-is-better; per figure the table
gives both medians, their ratio (current / baseline) and the median of the per-round ratios.
The gate is per measurement: per round, the geometric mean of its figures' ratios; the median
of those over the rounds must be <= 1.10 (see :class:`Score` for why not per figure).

``bench/compare_driver.py`` does one measurement of one tree; it runs against trees that do
not contain it (it is passed as source), through each bench's ``figures()`` where the tree has
one and through the benches' older functions where it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GATE = 1.10
ROUNDS = 5
RUN_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("compare_driver.py")

# Sizes per run of each measurement: enough for stable medians, small enough that the default
# compare (5 rounds, both trees) takes about 10 minutes on 2 cores. QUICK only checks that the
# runner works; its figures mean nothing.
SIZES: dict[str, dict[str, Any]] = {
    "claims": {"clients": [1, 16], "cycles": 128, "samples": 300},
    "mig-transition": {"runs": 1, "scenarios": 4},
    "metrics-scrape": {"scrapes": 200, "rounds": 2},
}
QUICK: dict[str, dict[str, Any]] = {
    "claims": {"clients": [1, 2], "cycles": 8, "samples": 10},
    "mig-transition": {"runs": 1, "scenarios": 1},
    "metrics-scrape": {"scrapes": 10, "rounds": 0},
}
TITLES = {
    "claims": "claims: prepare/unprepare over HTTP (gpu, mig, slice) and in-process",
    "mig-transition": "MIG transition overhead: wall time minus the simulated hardware time",
    "metrics-scrape": "metrics scrape: dgx-h100 at 8 GPUs + 56 MIG devices, and in-process",
}
MEASUREMENTS = tuple(SIZES)


@dataclass(frozen=True)
class Tree:
    label: str  # "baseline" or "current"
    root: Path
    describe: str  # the revision, for the header


@dataclass
class Figure:
    name: str
    baseline: list[float] = field(default_factory=list)
    current: list[float] = field(default_factory=list)

    @property
    def compared(self) -> bool:
        return bool(self.baseline) and len(self.baseline) == len(self.current)

    @property
    def ratio(self) -> float:
        """Median of the current runs over the median of the baseline runs."""
        return _ratio(statistics.median(self.current), statistics.median(self.baseline))

    @property
    def round_ratios(self) -> list[float]:
        return [_ratio(c, b) for b, c in zip(self.baseline, self.current, strict=True)]

    @property
    def round_ratio(self) -> float:
        """Median of the per-round ratios (each round pairs runs made a minute apart at
        most)."""
        return statistics.median(self.round_ratios)

    @property
    def passes(self) -> bool:
        return self.round_ratio <= GATE


@dataclass(frozen=True)
class Score:
    """One measurement's figures together: per round, the geometric mean of that round's
    figure ratios. The gate holds the median of these to <= 1.10: a single figure's ratio is
    too noisy on a shared machine for a gate, while a change that slows the agent moves most
    figures of its measurement at once."""

    figures: tuple[Figure, ...]  # the compared ones

    @property
    def ratio(self) -> float:
        return _geomean([f.ratio for f in self.figures])

    @property
    def round_ratios(self) -> list[float]:
        return [_geomean(list(r)) for r in zip(*(f.round_ratios for f in self.figures),
                                                 strict=True)]

    @property
    def round_ratio(self) -> float:
        return statistics.median(self.round_ratios)

    @property
    def passes(self) -> bool:
        return bool(self.figures) and self.round_ratio <= GATE


def _geomean(values: Sequence[float]) -> float:
    # A zero (a CPU time under one clock tick) would sink the mean; a microsecond stands in.
    return math.exp(statistics.fmean(math.log(max(v, 1e-6)) for v in values))


def _ratio(current: float, baseline: float) -> float:
    if baseline == current:
        return 1.0
    return current / baseline if baseline else math.inf


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _current() -> Tree:
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") \
        else ""
    return Tree("current", REPO, f"{head}{dirty} ({REPO})")


def machine() -> str:
    return (f"{os.cpu_count()} CPUs {platform.machine()}, "
            f"Python {platform.python_version()}")


def measure(tree: Tree, name: str, sizes: dict[str, Any], workdir: Path,
            timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One run of measurement ``name`` on ``tree`` in a subprocess: the driver's answer
    (``figures``, ``via``, ``seconds``)."""
    out = workdir / f"{tree.label}-{name}.json"
    log = workdir / f"{tree.label}-{name}.log"
    out.unlink(missing_ok=True)
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER.read_text(), name, json.dumps(sizes), str(out)],
            cwd=tree.root, env={**os.environ, "PYTHONPATH": str(tree.root)},
            stdout=sink, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                # SIGTERM first: the driver unwinds and its benches stop their agents.
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-4000:]
        why = f"timed out after {timeout_s:g} s" if rc is None else f"exited {rc}"
        raise RuntimeError(f"{name} on the {tree.label} tree {why}:\n{tail}")
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer


def compare(trees: tuple[Tree, Tree], names: Sequence[str], *, rounds: int,
            sizes: dict[str, dict[str, Any]], workdir: Path,
            timeout_s: float = RUN_TIMEOUT_S,
            loads: list[float] | None = None,
            via: dict[str, dict[str, str]] | None = None) -> dict[str, list[Figure]]:
    """Every measurement in ``names``, ``rounds`` times on both trees, the order swapped each
    round; the figures per measurement, in the order the current tree reports them. The
    1-minute load average after each run is appended to ``loads``; how each tree was driven
    goes into ``via[name][tree label]``."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        n: {"baseline": [], "current": []} for n in names}
    for r in range(rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name in names:
            for tree in order:
                answer = measure(tree, name, sizes[name], workdir, timeout_s)
                runs[name][tree.label].append(answer["figures"])
                if loads is not None:
                    loads.append(os.getloadavg()[0])
                if via is not None:
                    via.setdefault(name, {})[tree.label] = answer["via"]
                print(f"round {r + 1}/{rounds} {name:<15} {tree.label:<8} "
                      f"{answer['seconds']:6.1f} s via {answer['via']}",
                      file=sys.stderr, flush=True)
    out: dict[str, list[Figure]] = {}
    for name, sides in runs.items():
        order = list(dict.fromkeys([*sides["current"][0], *sides["baseline"][0]]))
        figures = [Figure(f) for f in order]
        for figure in figures:
            for side in ("baseline", "current"):
                values = [run[figure.name] for run in sides[side] if figure.name in run]
                if len(values) == rounds:
                    getattr(figure, side).extend(values)
        out[name] = figures
    return out


def _row(name: str, *, baseline: str, current: str, ratio: float, rounds: Sequence[float],
         mark: str) -> str:
    spread = f"{statistics.median(rounds):.3f} ({min(rounds):.3f}-{max(rounds):.3f})"
    return (f"{name:<46} {baseline:>9} {current:>9} {ratio:>6.3f} {spread:>31} {mark:>6}")


def report(figures: dict[str, list[Figure]], *, header: list[str]) -> tuple[list[str], bool]:
    """The tables and the verdict line; whether every measurement's score passes the gate."""
    lines = list(header)
    scores = {}
    for name, fs in figures.items():
        lines += ["", f"## {TITLES[name]}",
                  f"{'figure':<46} {'baseline':>9} {'current':>9} {'ratio':>6} "
                  f"{'round ratios: median (min-max)':>31} {f'<={GATE:.2f}':>6}"]
        for f in fs:
            if not f.compared:
                side = "baseline" if f.baseline else "current"
                lines.append(f"{f.name:<46} only the {side} tree reports it: not compared")
                continue
            lines.append(_row(f.name, baseline=f"{statistics.median(f.baseline):.3f}",
                              current=f"{statistics.median(f.current):.3f}", ratio=f.ratio,
                              rounds=f.round_ratios, mark="yes" if f.passes else "above"))
        score = scores[name] = Score(tuple(f for f in fs if f.compared))
        if score.figures:
            lines.append(_row(f"score: geometric mean of {len(score.figures)} ratios",
                              baseline="-", current="-", ratio=score.ratio,
                              rounds=score.round_ratios, mark="PASS" if score.passes else "FAIL"))
    failing = [n for n, s in scores.items() if not s.passes]
    above = [f for fs in figures.values() for f in fs if f.compared and not f.passes]
    lines.append("")
    verdict = ", ".join(
        f"{n} {s.round_ratio:.3f}" if s.figures else f"{n} (nothing compared)"
        for n, s in scores.items())
    lines.append(f"{'FAIL' if failing else 'PASS'}: median per-round score (current / baseline) "
                 f"<= {GATE:.2f}: {verdict}")
    if above:
        lines.append(f"figures whose own median per-round ratio is above {GATE:.2f} (not gated, "
                     f"look at them if the machine was quiet): "
                     + "; ".join(f"{f.name} {f.round_ratio:.3f}" for f in above))
    return lines, not failing


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MEASUREMENTS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown measurement {', '.join(unknown) or '(none)'}; choose from "
            f"{','.join(MEASUREMENTS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"runs of each measurement on each tree (default {ROUNDS})")
    parser.add_argument("--only", type=_names, default=list(MEASUREMENTS),
                        help=f"comma-separated, from {','.join(MEASUREMENTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sample counts: checks the runner, the figures mean nothing")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S,
                        help=f"seconds one run may take (default {RUN_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        commit = _git("rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"--baseline {args.baseline!r} is not a commit of {REPO}")
    sizes = QUICK if args.quick else SIZES
    current = _current()
    loads: list[float] = []
    via: dict[str, dict[str, str]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        workdir = Path(tmp)
        root = workdir / "baseline"
        _git("worktree", "add", "--detach", "--quiet", str(root), commit)
        try:
            baseline = Tree("baseline", root, f"{args.baseline} = {commit[:7]}")
            for tree in (baseline, current):  # compile once, so neither run pays for it
                subprocess.run([sys.executable, "-m", "compileall", "-q", "agent", "cdi",
                                "bench", "tests"], cwd=tree.root, check=False,
                               stdout=subprocess.DEVNULL)
            figures = compare((baseline, current), args.only, rounds=args.rounds, sizes=sizes,
                              workdir=workdir, timeout_s=args.timeout, loads=loads, via=via)
        finally:
            # If this fails, the prune below drops the entry once the directory is gone.
            with contextlib.suppress(subprocess.CalledProcessError):
                _git("worktree", "remove", "--force", str(root))
    _git("worktree", "prune")
    minutes = (time.monotonic() - began) / 60
    described = "; ".join(
        f"{n} " + ", ".join(f"{k} {','.join(map(str, v)) if isinstance(v, list) else v}"
                            for k, v in sizes[n].items()) for n in args.only)
    header = [f"# bench.compare: baseline {baseline.describe} vs current {current.describe}",
              f"# {args.rounds} round{'s' if args.rounds != 1 else ''}, order swapped each "
              f"round, {minutes:.1f} min; {machine()}",
              f"# sizes per run: {described}",
              "# driven through: " + "; ".join(
                  f"{side} {', '.join(sorted({v[side] for v in via.values()}))}"
                  for side in ("baseline", "current")),
              f"# load average (1 min) after each run: median {statistics.median(loads):.1f}, "
              f"max {max(loads):.1f} (the compare's own client and agent count)",
              f"# every figure lower-is-better; ratio = current / baseline medians; gate: "
              f"per measurement, median over rounds of the geometric mean of the round's "
              f"figure ratios <= {GATE:.2f}"]
    lines, passed = report(figures, header=header)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "baseline": baseline.describe, "current": current.describe, "rounds": args.rounds,
            "sizes": sizes, "machine": machine(), "passed": passed, "via": via,
            "figures": {n: [{"name": f.name, "baseline": f.baseline, "current": f.current}
                            for f in fs] for n, fs in figures.items()}}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
