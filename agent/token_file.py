"""The client side of a token file: which token a file gives a client (the CLI, the kubelet
plugin). The agent's own reading of the file, names and scopes, is ``agent/api/auth.py``."""

from __future__ import annotations


def first_token(text: str) -> str | None:
    """The token of the first line that has one: the token alone (as the kubelet plugin's
    Secret holds it) or the agent's own ``name:token[:scopes]`` line, whose second field is
    the token; ``#`` lines are comments. None when no line has one."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(":")
        token = fields[1].strip() if len(fields) > 1 else line
        if token:
            return token
    return None
