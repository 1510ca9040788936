"""Reading the CLI's token file (issue 24): the bare token the kubelet plugin and its Secret
hold works as well as the agent's own ``name:token[:scopes]`` line; a file with no token is one
line that says what to put in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli.client import ClientError, discover, read_token_file


@pytest.mark.parametrize(("text", "token"), [
    ("s3cret\n", "s3cret"),
    ("s3cret", "s3cret"),
    ("  s3cret  \n", "s3cret"),
    ("# the plugin's token\n\ns3cret\n", "s3cret"),
    ("ops:s3cret\n", "s3cret"),
    ("ops:s3cret:read,write\n", "s3cret"),
    ("# comment\nops:s3cret:read\nother:t2\n", "s3cret"),
])
def test_the_token_is_read_bare_or_from_a_name_token_line(tmp_path: Path, text: str,
                                                          token: str) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    assert read_token_file(path) == token
    assert discover("http://127.0.0.1:1", str(path))[1] == token


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "ops:\n"])
def test_a_file_without_a_token_is_one_clear_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(ClientError) as caught:
        read_token_file(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and "no token" in message


def test_a_missing_token_file_says_how_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="--token-file"):
        discover("http://127.0.0.1:1", str(tmp_path / "absent"))
