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


def test_mps_host_help_lists_its_required_flag_as_required() -> None:
    host = next(a for a in parser()._actions
                if isinstance(a, argparse._SubParsersAction)).choices["mps-host"]
    text = host.format_help()
    required = text[text.index("required arguments:"):]
    assert "--socket PATH" in required.split("\n\n")[0]
    options = text[text.index("options:"):].split("\n\n")[0]
    assert "--socket PATH" not in options
