"""Access control around the API: TLS, the Unix socket's owner, token reloads and audit lines.

Secrets never reach a log line or an error: tokens are named by their *name*, request bodies
are summarised with secret-looking fields redacted, and the Authorization header is never read
here at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import re
import socket
import ssl
import struct
from pathlib import Path
from typing import Any

from agent.api.auth import TokenStore
from agent.api.body import BodyError, load_json
from agent.errors import AgentError
from agent.settings import Settings

log = logging.getLogger("agent.access")
audit_log = logging.getLogger("agent.audit")

#: Body fields never written to an audit line, whatever their value.
_SECRET_WORDS = ("token", "secret", "password", "authorization", "key", "credential")
_SECRET_FIELD = re.compile("|".join(_SECRET_WORDS))
_SUMMARY_CHARS = 300
_SUMMARY_PARSE_BYTES = 16 * 1024


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The server context of the TCP listeners, or ``None`` without --tls-cert."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
        if settings.tls_client_ca is not None:
            context.load_verify_locations(cafile=str(settings.tls_client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as err:
        # The message names the files, never their contents.
        reason = getattr(err, "strerror", None) or getattr(err, "reason", None) or str(err)
        raise AgentError(f"TLS: cannot load --tls-cert {settings.tls_cert} / --tls-key "
                         f"{settings.tls_key} / --tls-client-ca {settings.tls_client_ca}: "
                         f"{reason}") from err
    return context


def set_socket_owner(path: Path, group: str | None) -> None:
    """Mode 0660, and the group ``group`` (a name or a number) when given."""
    os.chmod(path, 0o660)
    if group is None:
        return
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError as err:
        raise AgentError(f"--socket-group {group!r}: no such group") from err
    try:
        os.chown(path, -1, gid)
    except OSError as err:
        raise AgentError(f"--socket-group {group!r}: cannot give {path} to it: "
                         f"{err.strerror}") from err


def peer_credentials(sock: socket.socket | None) -> str | None:
    """``uid=U gid=G pid=P`` of the process at the other end of a Unix socket."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return f"uid={uid} gid={gid} pid={pid}"


#: Objects and arrays nested deeper than this are summarised as ``...`` in an audit line.
_SUMMARY_DEPTH = 6


def _redact(value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict | list) and depth >= _SUMMARY_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {k: "<redacted>" if _SECRET_FIELD.search(str(k).lower())
                else _redact(v, depth + 1) for k, v in list(value.items())[:16]}
    if isinstance(value, list):
        return [_redact(v, depth + 1) for v in value[:8]]
    if isinstance(value, str) and len(value) > _SUMMARY_CHARS:
        return value[:_SUMMARY_CHARS] + "..."
    return value


#: ``parsed`` not given: :func:`summarise_body` parses ``raw`` itself.
UNPARSED = object()


def summarise_body(raw: bytes, content_type: str, parsed: Any = UNPARSED) -> str:
    """A short, secret-free description of a request body for the audit line; ``parsed``:
    the document ``raw`` already parsed to (:func:`~agent.api.body.load_json`), when the
    handler did. It never raises, whatever the body: the audit line of a refused request
    matters most."""
    if not raw:
        return "-"
    kind = content_type[:64] or "unknown type"
    # Parsing is bounded too: the line is written for requests without a token as well.
    if not content_type.endswith("json") or len(raw) > _SUMMARY_PARSE_BYTES:
        return f"<{len(raw)} bytes {kind}>"
    doc = parsed
    if doc is UNPARSED:
        try:
            doc = load_json(raw)
        except BodyError as err:
            return f"<{len(raw)} bytes, refused: {err}>"
    try:
        text = json.dumps(_redact(doc), separators=(",", ":"), default=str)
    except (ValueError, TypeError, RecursionError):  # pragma: no cover - bounded by _redact
        return f"<{len(raw)} bytes {kind}>"
    return text if len(text) <= _SUMMARY_CHARS else text[:_SUMMARY_CHARS] + "..."


class TokenReloader:
    """Re-reads the token file on SIGHUP and when its modification time or size changes; a
    reload that fails keeps the tokens in use and says why."""

    def __init__(self, holder: Any, path: Path, interval_s: float = 2.0) -> None:
        self._holder = holder  # anything with a ``tokens`` attribute (the AgentContext)
        self.path = path
        self.interval_s = interval_s
        self._seen = self._stamp()
        self._task: asyncio.Task[None] | None = None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, why: str) -> bool:
        self._seen = self._stamp()
        try:
            store = TokenStore.load(self.path)
        except AgentError as err:
            log.error("token reload failed; keeping the previous tokens",
                      extra={"reason": why, "error": err.detail})
            return False
        self._holder.tokens = store
        log.info("tokens reloaded", extra={"reason": why, "names": ",".join(store.names())})
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._stamp() != self._seen:
                self.reload("file changed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
