"""The simulated agent's token line (issue 24) goes to stderr: stdout stays the program's own
output, for whoever pipes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.daemon import load_tokens
from agent.settings import resolve


def test_the_simulated_token_is_printed_on_stderr(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    settings = resolve({"simulate": "dgx-h100", "state_dir": str(tmp_path / "state")}, env={})
    load_tokens(settings)
    out, err = capsys.readouterr()
    token = (settings.state_dir / "tokens").read_text().split(":")[1].strip()
    assert out == ""
    assert f"simulated agent token (also in {settings.state_dir / 'tokens'}): {token}" in err
