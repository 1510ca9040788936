"""The cost-per-claim benchmark runs on tiny inputs, through both paths, and its table puts the
issue's targets on the right figures (so it cannot rot). Timings are not asserted: only what
does not depend on the machine's speed."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import claim_cost

REPO = Path(claim_cost.__file__).resolve().parents[1]


def test_one_measurement_reports_every_figure_of_both_paths() -> None:
    """A real agent and plugin, a few cycles of each path and kind and one batch at once:
    every figure is there, CPU figures are non-negative and the prepare latencies positive."""
    figures = claim_cost.measure(cycles=4, batches=1, block=2)
    for kind in claim_cost.KINDS:
        for name in (f"agent CPU ms/cycle, REST, {kind}",
                     f"agent CPU ms/cycle, plugin path, {kind}",
                     f"plugin CPU ms/cycle, {kind}"):
            assert figures[name] >= 0, name
        for path in ("REST", "plugin path"):
            assert figures[f"prepare p50 ms, {path}, {kind}"] > 0
        assert math.isfinite(figures[f"plugin hop over REST p50 ms, {kind}"])
    assert figures["prepare p50 ms, plugin path, 49 at once"] > 0


def test_the_table_marks_the_targets_on_cpu_and_hop_figures_only() -> None:
    """Ratio = current / baseline medians; the 0.5x target is judged on the agent's CPU, the
    plugin's CPU and the hop, and on nothing else."""
    base = {"agent CPU ms/cycle, REST, gpu": 4.0, "plugin hop over REST p50 ms, gpu": 2.0,
            "prepare p50 ms, REST, gpu": 5.0}
    cur = {"agent CPU ms/cycle, REST, gpu": 1.8, "plugin hop over REST p50 ms, gpu": 1.5,
           "prepare p50 ms, REST, gpu": 4.0}
    lines = claim_cost.report({"baseline": [base, base], "current": [cur, cur]}, ["# h"])
    rows = {line.split("  ")[0]: line for line in lines[2:]}
    assert rows["agent CPU ms/cycle, REST, gpu"].split()[-3:] == ["<=", "0.5x:", "yes"]
    assert " 0.450 " in rows["agent CPU ms/cycle, REST, gpu"]
    assert rows["plugin hop over REST p50 ms, gpu"].split()[-3:] == ["<=", "0.5x:", "NO"]
    assert "0.5x" not in rows["prepare p50 ms, REST, gpu"]


@pytest.mark.slow
def test_side_by_side_against_head_leaves_no_worktree() -> None:
    """The driver measures a git revision (checked out in a temporary worktree, removed at
    the end) beside this tree and prints one row per figure."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.claim_cost", "--baseline", "HEAD", "--rounds", "1",
         "--cycles", "2", "--batches", "1"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if not line.startswith(("#", "figure"))]
    assert len(rows) == 15 and not any("only the current" in r for r in rows), done.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout
    assert "bench-claim-cost-" not in worktrees
