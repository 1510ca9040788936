"""Which token a token file gives a client (the CLI and the kubelet plugin read it alike)."""

from __future__ import annotations

import pytest

from agent.token_file import first_token


@pytest.mark.parametrize(("text", "token"), [
    ("s3cret\n", "s3cret"),                                  # the plugin's Secret: alone
    ("ops:s3cret\n", "s3cret"),                              # the agent's own line
    ("ops:s3cret:claims,read\n", "s3cret"),                  # with scopes
    ("# made by gpu-agent\n\n  ops:s3cret  \n", "s3cret"),   # comments, blanks, spaces
    ("ops:\nplugin:later\n", "later"),                       # a line without a token is passed
    ("first\nsecond\n", "first"),                            # the first line that has one
    ("", None),
    ("# only a comment\n\n", None),
    ("ops:  \n", None),
])
def test_the_first_line_with_a_token_gives_it(text: str, token: str | None) -> None:
    assert first_token(text) == token
