"""Which Go the Go test programs are built with (tests/gobuild.py): the newest found, and one
older than the module's go line (Debian's 1.19) counts as missing: a skip on a developer
machine, a failure under CI=true."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests import gobuild


def _fake_go(directory: Path, version: str) -> Path:
    directory.mkdir(parents=True)
    go = directory / "go"
    go.write_text(f'#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && echo go{version}\n')
    go.chmod(0o755)
    return go


@pytest.fixture
def module(tmp_path: Path) -> Path:
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "go.mod").write_text("module example.com/m\n\ngo 1.24\n")
    return tmp_path / "mod"


Use = Callable[..., None]


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Use:
    """Make the given fake toolchains the only ones to be found (PATH, $GO, KNOWN_GO)."""
    def use(*gos: Path) -> None:
        monkeypatch.setenv("PATH", str(gos[0].parent) if gos else str(tmp_path / "empty"))
        monkeypatch.delenv("GO", raising=False)
        monkeypatch.setattr(gobuild, "KNOWN_GO", gos[1:])
    return use


def test_the_newest_go_wins_over_an_older_one_first_on_path(tmp_path: Path, module: Path,
                                                             only: Use) -> None:
    """Debian's Go first on PATH does not shadow the machine's newer one."""
    debian = _fake_go(tmp_path / "debian", "1.19.8")
    local = _fake_go(tmp_path / "local", "1.26.8")
    only(debian, local)
    assert gobuild.find_go(module) == str(local)


@pytest.mark.parametrize("ci", ["true", None])
@pytest.mark.parametrize("installed", ["1.19.8", None], ids=["too-old", "none"])
def test_a_missing_or_too_old_go_fails_in_ci_and_skips_elsewhere(
        tmp_path: Path, module: Path, only: Use, ci: str | None, installed: str | None) -> None:
    """No usable Go: CI fails the test, a developer machine skips it, saying why."""
    only(*([_fake_go(tmp_path / "debian", installed)] if installed else []))
    with pytest.MonkeyPatch.context() as patch:
        if ci:
            patch.setenv("CI", ci)
        else:
            patch.delenv("CI", raising=False)
        expected = pytest.fail.Exception if ci else pytest.skip.Exception
        with pytest.raises(expected, match=r"too old|not installed"):
            gobuild.find_go(module)
