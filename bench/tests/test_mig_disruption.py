"""The disruption benchmark runs and its result adds up (so the benchmark cannot rot)."""

from __future__ import annotations

import pytest

from bench import mig_disruption
from bench.mig_disruption import DisruptionResult


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100"])
def test_run_counts_destroyed_instances(preset: str) -> None:
    result = mig_disruption.run(preset, pairs=20, seed=1)
    assert isinstance(result, DisruptionResult)
    assert (result.preset, result.pairs, result.seed) == (preset, 20, 1)
    assert result.gpu
    assert result.geometries > 1000  # A100/H100: every legal MIG geometry, the empty one too
    assert 0 <= result.minimum <= result.planned <= result.clear_and_recreate
    assert result.at_minimum == result.pairs  # the planner's target: the minimum on every pair
    assert result.clear_and_recreate > 0
    assert 0.0 <= result.ratio <= 1.0
    assert result.planned_mean == result.planned / 20
    # Times are measured, not bounded here (a 1 s stall of a loaded machine is no failure):
    # only that they were taken.
    assert 0.0 < result.plan_median_s <= result.plan_p99_s


def test_run_is_reproducible_from_the_seed() -> None:
    first = mig_disruption.run("hgx-h200", pairs=20, seed=7)
    again = mig_disruption.run("hgx-h200", pairs=20, seed=7)
    timing = ("plan_median_s", "plan_p99_s")
    fields = [f for f in DisruptionResult.__dataclass_fields__ if f not in timing]
    assert [getattr(first, f) for f in fields] == [getattr(again, f) for f in fields]


def test_main_prints_one_row_per_preset(capsys: pytest.CaptureFixture[str]) -> None:
    mig_disruption.main(pairs=5, seed=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# MIG disruption") and "CPUs" in lines[0]
    assert len(lines) == 2 + len(mig_disruption.PRESETS)
    for preset, line in zip(mig_disruption.PRESETS, lines[2:], strict=True):
        assert line.split()[0] == preset
