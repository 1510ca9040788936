"""``topo slices --kubernetes`` takes every version the agent's API does (issue 24)."""

from __future__ import annotations

import pytest

from agent.cli.main import parser


@pytest.mark.parametrize("version", ["1.34", "1.35", "1.36", "1.37"])
def test_each_version_the_api_knows_is_taken(version: str) -> None:
    assert parser().parse_args(["topo", "slices", "--kubernetes", version]).kubernetes == version


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["topo", "slices", "--kubernetes", "1.33"])
