"""A bounded run of the load driver (the runner does ≥ 10,000 operations)."""

from __future__ import annotations

from pathlib import Path

from bench.load import run, table


def test_load_loses_no_claim_and_answers_only_specified_codes(tmp_path: Path) -> None:
    figures = run(operations=1_000, clients=64, seed=3, workdir=tmp_path)
    assert not figures.failures, table(figures, clients=64, seed=3)
    assert figures.operations >= 1_000
    assert sum(figures.codes["unprepare:gpu"].values()) > 0
    assert sum(figures.codes["unprepare:mig"].values()) > 0
    assert sum(figures.codes["unprepare:slice"].values()) > 0
    assert figures.snapshots >= 2
    assert sum(figures.codes["metrics"].values()) >= 5
