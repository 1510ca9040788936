"""The plugin's one way to the agent: its REST API over the Unix socket
(:mod:`agent.kubeplugin.agent_http`), with the ``claims``-scoped token from a file.

Statuses become the errors of :mod:`agent.kubeplugin.errors`: 503 is :class:`AgentNotReady`
(with ``Retry-After``), any other error status :class:`AgentRefused` with the problem body,
and no answer at all :class:`AgentUnreachable`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

from multidict import CIMultiDict

from agent.kubeplugin.agent_http import UnixHttp
from agent.kubeplugin.errors import (
    AgentNotReady,
    AgentRefused,
    AgentUnreachable,
    TokenFileError,
)

log = logging.getLogger("agent.kubeplugin.agent")

#: A prepare may wait for MIG creation or for device nodes; kubelet gives up after 45 s but
#: the plugin lets the call finish so that the retry finds the result.
CLAIM_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 5.0
#: Concurrent connections to the agent: above the 56 MIG devices of a full node, so that no
#: prepare queues behind another in the client.
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class ResourceSlicesAnswer:
    """``GET /v1/resourceslices``: the ETag, and the items (None: unchanged, a 304)."""

    etag: str | None
    items: list[dict[str, Any]] | None


class TokenFile:
    """The bearer token in a file, re-read whenever the file changes (a rotated Secret swaps
    the file, so its inode, size or mtime moves), refused when group or others may read or
    write it.

    The file holds the token alone on its first line, or the agent's own token-file line
    ``name:token[:scopes]`` (then the second field is the token); ``#`` lines are comments.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int, int] | None = None
        self._token = ""

    def token(self) -> str:
        """The current token; :class:`TokenFileError` naming the file and the reason when it
        cannot be used."""
        try:
            info = self.path.stat()
        except OSError as err:
            raise TokenFileError(f"token file {self.path}: {err.strerror}") from err
        if info.st_mode & 0o077:
            raise TokenFileError(
                f"token file {self.path} is readable or writable by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); make it 0600 (chmod 600, or a Secret "
                "volume with defaultMode 0600 and no fsGroup)")
        seen = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if seen != self._seen:
            self._token = self._read()
            if self._seen is not None:
                log.info("token file changed; using the new token", extra={"path": str(self.path)})
            self._seen = seen
        return self._token

    def _read(self) -> str:
        try:
            text = self.path.read_text()
        except OSError as err:
            raise TokenFileError(f"token file {self.path}: {err.strerror}") from err
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split(":")
            token = fields[1].strip() if len(fields) > 1 else line
            if token:
                return token
        raise TokenFileError(f"token file {self.path} holds no token")


def _retry_after(value: str | None) -> float:
    try:
        return max(float(value or 1), 0.0)
    except ValueError:  # an HTTP date: not sent by the agent; retry soon
        return 1.0


class AgentClient:
    """The agent's claims and ResourceSlice API on ``socket``, authenticated with the token in
    ``token_file``. Connections are opened on first use (inside the event loop)."""

    def __init__(self, socket: Path, token_file: Path, *,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        self.socket = socket
        self.tokens = TokenFile(token_file)
        self._claim_timeout_s = claim_timeout_s
        self._http = UnixHttp(str(socket), limit=MAX_CONNECTIONS)

    async def _call(self, method: str, path: str, *, timeout_s: float, body: Any = None,
                    params: dict[str, str] | None = None,
                    headers: dict[str, str] | None = None,
                    auth: bool = True) -> tuple[int, CIMultiDict[str], Any]:
        sent = dict(headers or {})
        if auth:
            sent["Authorization"] = f"Bearer {self.tokens.token()}"
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._http.request(method, path, body=body, params=params,
                                                    headers=sent, connect_timeout_s=5)
        except TimeoutError as err:
            raise AgentUnreachable(f"agent socket {self.socket}: no answer to {method} {path} "
                                   f"within {timeout_s:.0f} s") from err
        except OSError as err:
            raise AgentUnreachable(f"agent socket {self.socket}: {err}") from err
        answer: Any = None
        if response.body:
            try:
                answer = json.loads(response.body)
            except ValueError:
                answer = {"detail": response.body[:500].decode(errors="replace")}
        return response.status, response.headers, answer

    @staticmethod
    def _raise(status: int, headers: Mapping[str, str], answer: Any) -> NoReturn:
        problem = answer if isinstance(answer, dict) else {}
        if status == 503:
            detail = str(problem.get("detail") or problem.get("title") or "agent not ready")
            raise AgentNotReady(_retry_after(headers.get("Retry-After")), detail, problem)
        raise AgentRefused(status, problem)

    async def prepare(self, uid: str, body: dict[str, Any]) -> dict[str, Any]:
        """``PUT /v1/claims/{uid}``: the prepared claim (``devices`` with ``cdi_devices``)."""
        status, headers, answer = await self._call(
            "PUT", f"/v1/claims/{quote(uid, safe='')}", body=body,
            timeout_s=self._claim_timeout_s)
        if status != 200 or not isinstance(answer, dict):
            self._raise(status, headers, answer)
        result: dict[str, Any] = answer
        return result

    async def unprepare(self, uid: str, issued_at_ns: int) -> None:
        """``DELETE /v1/claims/{uid}?issued_at_ns=N``; an unknown claim is success."""
        status, headers, answer = await self._call(
            "DELETE", f"/v1/claims/{quote(uid, safe='')}",
            params={"issued_at_ns": str(issued_at_ns)}, timeout_s=self._claim_timeout_s)
        if status not in (200, 204, 404):
            self._raise(status, headers, answer)

    async def claims(self) -> list[dict[str, Any]]:
        """``GET /v1/claims``: every claim the agent holds, with its state and devices."""
        status, headers, answer = await self._call("GET", "/v1/claims",
                                                   timeout_s=READY_TIMEOUT_S)
        claims = answer.get("claims") if isinstance(answer, dict) else None
        if status == 200 and isinstance(claims, list):
            return [c for c in claims if isinstance(c, dict)]
        self._raise(status, headers, answer)

    async def resource_slices(self, kubernetes: str, etag: str | None,
                              wait_s: float) -> ResourceSlicesAnswer:
        """``GET /v1/resourceslices?kubernetes=X``; with ``etag``, held up to ``wait_s`` for a
        change (``items`` None: unchanged)."""
        params = {"kubernetes": kubernetes}
        headers = {}
        if etag is not None:
            headers["If-None-Match"] = etag
            params["wait_s"] = f"{wait_s:g}"
        status, got, answer = await self._call(
            "GET", "/v1/resourceslices", params=params, headers=headers,
            timeout_s=wait_s + 30)
        if status == 304:
            return ResourceSlicesAnswer(got.get("ETag", etag), None)
        if status != 200 or not isinstance(answer, dict):
            self._raise(status, got, answer)
        return ResourceSlicesAnswer(got.get("ETag"), list(answer.get("items") or []))

    async def readiness(self) -> str | None:
        """None when the agent answers ``/readyz`` 200; else why not (unreachable, or its
        own reason for not being ready)."""
        try:
            status, _, answer = await self._call("GET", "/readyz", timeout_s=READY_TIMEOUT_S,
                                                 auth=False)
        except AgentUnreachable as err:
            return f"agent unreachable: {err.reason}"
        if status == 200:
            return None
        reason = answer.get("reason") or answer.get("detail") if isinstance(answer, dict) \
            else None
        return f"agent not ready (HTTP {status})" + (f": {reason}" if reason else "")

    async def ready(self) -> bool:
        """Whether the agent answers and is ready."""
        return await self.readiness() is None

    async def close(self) -> None:
        """Close the connections to the agent (a later call opens new ones)."""
        self._http.close()


def token_file_usable(path: Path) -> str | None:
    """Why the token file at ``path`` cannot be used at start-up, or None."""
    try:
        TokenFile(path).token()
    except TokenFileError as err:
        return str(err)
    return None
