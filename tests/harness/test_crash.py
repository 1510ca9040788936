"""A bounded run of the crash-consistency harness (the runner does thousands)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.crash import run


@pytest.mark.slow
def test_crash_trials_keep_every_invariant(tmp_path: Path) -> None:
    figures = run(trials=20, seed=8, workdir=tmp_path)
    assert figures.trials == 20
    assert figures.kills >= 15
    assert figures.early_answers > 0  # requests really met the agent before it was ready
