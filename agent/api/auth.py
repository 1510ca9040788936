"""Bearer tokens: ``name:token[:scope,...]`` lines, compared in constant time.

The token's *name* appears in logs and audit lines; the token itself never does.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.durable import write_atomic
from agent.errors import Forbidden, InvalidRequest, Unauthorized

SCOPES = frozenset({"read", "claims", "geometry", "admin"})


@dataclass(frozen=True)
class Principal:
    name: str
    scopes: frozenset[str]

    def require(self, scope: str) -> None:
        """Raise :class:`Forbidden` unless this principal holds ``scope`` (``admin`` holds all)."""
        if scope not in self.scopes and "admin" not in self.scopes:
            raise Forbidden(f"token {self.name!r} lacks the {scope!r} scope", scope=scope)


@dataclass(frozen=True)
class _Token:
    principal: Principal
    secret: bytes


class TokenStore:
    """Tokens loaded from a file. A line without scopes grants every scope."""

    def __init__(self, tokens: list[_Token], source: Path | None) -> None:
        self._tokens = tokens
        self.source = source

    @classmethod
    def empty(cls) -> TokenStore:
        return cls([], None)

    @classmethod
    def load(cls, path: Path) -> TokenStore:
        """Parse a token file; a malformed line stops the start with the line number, and a
        file the group or others may read is refused (its secrets are no longer secret)."""
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o077:
                raise InvalidRequest(
                    f"token file {path} is readable or writable by group or others (mode "
                    f"{mode:04o}); refusing it. Run 'chmod 600 {path}' (owned by the agent's "
                    "user) and start again")
            text = path.read_text()
        except OSError as err:
            raise InvalidRequest(f"token file {path}: {err.strerror}") from err
        tokens: list[_Token] = []
        names: set[str] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(":")
            if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
                raise InvalidRequest(f"token file {path} line {number}: expected "
                                     "name:token[:scope,...]")
            name, secret = parts[0], parts[1]
            # ``name:token`` and ``name:token:`` both list no scope: all of them, as documented.
            scopes = frozenset(s.strip() for s in parts[2].split(",") if s.strip()) \
                if len(parts) == 3 else frozenset()
            scopes = scopes or SCOPES
            unknown = scopes - SCOPES
            if unknown:
                raise InvalidRequest(f"token file {path} line {number}: unknown scope(s) "
                                     f"{', '.join(sorted(unknown))}; known: "
                                     f"{', '.join(sorted(SCOPES))}")
            if name in names:
                raise InvalidRequest(f"token file {path} line {number}: duplicate name {name!r}")
            names.add(name)
            tokens.append(_Token(Principal(name, scopes), secret.encode()))
        return cls(tokens, path)

    @property
    def configured(self) -> bool:
        return bool(self._tokens)

    def authenticate(self, header: str | None) -> Principal:
        """The principal of an ``Authorization: Bearer`` header, or :class:`Unauthorized`."""
        scheme, _, credentials = (header or "").strip().partition(" ")
        # RFC 9110 §11.1: the scheme is case-insensitive.
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthorized("missing bearer token (send 'Authorization: Bearer <token>')")
        try:
            # aiohttp hands undecodable header bytes over as surrogates; a token is ASCII.
            offered = credentials.strip().encode("ascii")
        except UnicodeEncodeError:
            raise Unauthorized("the Authorization header is not ASCII; a bearer token is") \
                from None
        found: Principal | None = None
        # Compare against every token so the time taken does not say which one nearly matched.
        for token in self._tokens:
            if hmac.compare_digest(offered, token.secret):
                found = token.principal
        if found is None:
            raise Unauthorized("invalid bearer token")
        return found

    def names(self) -> list[str]:
        """The token names (never the secrets), for logs."""
        return [t.principal.name for t in self._tokens]


def generate_token_file(path: Path, name: str = "sim") -> str:
    """Write a fresh all-scopes token to ``path`` (mode 0600) and return the token."""
    token = secrets.token_urlsafe(32)
    write_atomic(path, f"{name}:{token}\n".encode(), mode=0o600)
    return token
