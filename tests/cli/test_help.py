"""``--help`` reads as plain text (issue 24): no reST markup from the docstrings, and required
flags shown as required."""

from __future__ import annotations

import pytest

from agent.cli.main import parser


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``gpu-agent ARGV --help`` prints (argparse exits 0 after printing it)."""
    with pytest.raises(SystemExit) as done:
        parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["node"], ["gpus"], ["claims"], ["topo"], ["sim"], ["mig"],
                                  ["mps-host"], ["kubelet-plugin"], ["serve"]])
def test_help_has_no_rst_backticks(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(argv, capsys)
    assert text.strip()
    assert "``" not in text


def test_mps_host_help_lists_its_required_flag_as_required(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["mps-host"], capsys)
    required = text[text.index("required arguments:"):]
    assert "--socket PATH" in required.split("\n\n")[0]
    options = text[text.index("options:"):].split("\n\n")[0]
    assert "--socket PATH" not in options
