"""``--help`` reads as plain text (issue 24): no reST markup from the docstrings."""

from __future__ import annotations

import argparse

import pytest

from agent.cli.main import parser


@pytest.mark.parametrize("argv", [[], ["gpus"], ["claims"], ["topo"], ["sim"]])
def test_help_has_no_rst_backticks(argv: list[str]) -> None:
    top = parser()
    target = top
    for word in argv:
        target = next(a for a in target._actions
                      if isinstance(a, argparse._SubParsersAction)).choices[word]
    text = target.format_help()
    assert "``" not in text
    assert text.strip()
