"""Token files: parsing, scopes, constant-time lookup results, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.api.auth import SCOPES, TokenStore, generate_token_file
from agent.errors import Forbidden, InvalidRequest, Unauthorized


def _store(tmp_path: Path, text: str) -> TokenStore:
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(0o600)
    return TokenStore.load(path)


def test_tokens_with_and_without_scopes(tmp_path: Path) -> None:
    store = _store(tmp_path, "# comment\nops:s3cret\nscheduler:abc:claims,read\n\n")
    assert store.authenticate("Bearer s3cret").scopes == SCOPES
    scheduler = store.authenticate("Bearer abc")
    assert scheduler.name == "scheduler"
    scheduler.require("claims")
    with pytest.raises(Forbidden, match="lacks the 'geometry' scope"):
        scheduler.require("geometry")


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer wrong", "Bearer "])
def test_missing_or_wrong_token_is_unauthorized(tmp_path: Path, header: str | None) -> None:
    store = _store(tmp_path, "ops:s3cret\n")
    with pytest.raises(Unauthorized):
        store.authenticate(header)


@pytest.mark.parametrize(("text", "message"), [
    ("justaname\n", "line 1: expected name:token"),
    ("a:b\na:c\n", "line 2: duplicate name 'a'"),
    ("a:b:read,root\n", "unknown scope\\(s\\) root"),
    (":token\n", "line 1"),
])
def test_malformed_token_file_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        _store(tmp_path, text)


def test_generated_token_file_is_private_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    token = generate_token_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert TokenStore.load(path).authenticate(f"Bearer {token}").name == "sim"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_token_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "tokens"
    path.write_text("ops:s3cret\n")
    path.chmod(mode)
    with pytest.raises(InvalidRequest, match="chmod 600") as caught:
        TokenStore.load(path)
    assert "s3cret" not in caught.value.detail
