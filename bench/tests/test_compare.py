"""``bench.compare`` against HEAD with tiny sample counts: it checks the baseline out, runs
every measurement on both trees, prints one table per measurement whose ratios are finite and
a verdict that matches its exit status, and leaves no worktree behind. Timings are not
asserted (tiny samples on a shared machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compare, compare_driver

ROUNDS = 2  # two, so the order swaps once and a median of per-round ratios is taken


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=compare.REPO,
                          check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_compare_against_head_reports_finite_ratios(tmp_path: Path) -> None:
    """Every figure of every measurement is compared on both trees in every round, each row's
    ratios are positive and finite, and the verdict line agrees with the exit status."""
    dump = tmp_path / "compare.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--baseline", "HEAD", "--rounds", str(ROUNDS),
         "--quick", "--json", str(dump)],
        cwd=compare.REPO, env={**os.environ, "PYTHONPATH": str(compare.REPO)},
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    lines = done.stdout.splitlines()
    sections = [line.removeprefix("## ") for line in lines if line.startswith("## ")]
    assert sections == [compare.TITLES[n] for n in compare.MEASUREMENTS]

    rows = [line for line in lines if line.endswith((" yes", " above", " PASS", " FAIL"))]
    scores = [line for line in rows if line.startswith("score: ")]
    assert len(scores) == len(compare.MEASUREMENTS)
    for row in rows:
        # ... ratio  median (min-max)  mark
        ratio, median, spread = row.split()[-4:-1]
        low, high = spread.strip("()").split("-")
        for value in (ratio, median, low, high):
            assert 0 < float(value) < math.inf, row
        assert float(low) <= float(median) <= float(high), row
    assert not any("not compared" in line for line in lines), done.stdout

    verdict = next(line for line in lines if line.startswith(("PASS:", "FAIL:")))
    assert verdict.startswith("PASS:") == (done.returncode == 0), done.stdout
    assert all(f"{n} " in verdict for n in compare.MEASUREMENTS)

    recorded = json.loads(dump.read_text())
    assert recorded["rounds"] == ROUNDS
    assert set(recorded["figures"]) == set(compare.MEASUREMENTS)
    for figures in recorded["figures"].values():
        assert figures
        for figure in figures:
            assert len(figure["baseline"]) == len(figure["current"]) == ROUNDS, figure
    # This tree's benches are driven through their figures() (a baseline without them goes
    # through the driver's adapters of the older benches, under the same figure names).
    assert {n: v["current"] for n, v in recorded["via"].items()} == {
        n: f"{compare_driver.MODULES[n]}.figures" for n in compare.MEASUREMENTS}
    assert "bench-compare-" not in _worktrees()
