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
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

from multidict import CIMultiDict

from agent.kubeplugin import reasons
from agent.kubeplugin.agent_http import UnixHttp
from agent.kubeplugin.errors import (
    AgentNotReady,
    AgentRefused,
    AgentUnreachable,
    TokenFileError,
)
from agent.token_file import first_token

log = logging.getLogger("agent.kubeplugin.agent")

#: A prepare may wait for MIG creation or for device nodes; kubelet gives up after 45 s but
#: the plugin lets the call finish so that the retry finds the result.
CLAIM_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 5.0
#: Concurrent connections to the agent: above the 56 MIG devices of a full node, so that no
#: prepare queues behind another in the client.
MAX_CONNECTIONS = 256
#: What to do about an agent that does not answer, in its reason and its log line.
UNREACHABLE_HINT = "start the agent, or give --agent-socket the socket it listens on"


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
        token = first_token(text)
        if token is not None:
            return token
        raise TokenFileError(f"token file {self.path} holds no token")


def _retry_after(value: str | None) -> float:
    try:
        return max(float(value or 1), 0.0)
    except ValueError:  # an HTTP date: not sent by the agent; retry soon
        return 1.0


@dataclass(frozen=True)
class TokenCheck:
    """What ``GET /v1/whoami`` said of the plugin's token: None (accepted with the ``claims``
    scope, or an agent too old to say) or why the agent refuses it."""

    problem: str | None
    name: str | None = None


class AgentClient:
    """The agent's claims and ResourceSlice API on ``socket``, authenticated with the token in
    ``token_file``. Connections are opened on first use (inside the event loop).

    Every call says whether the agent answered: the first call that finds it away and the
    first that finds it back each write one log line (``agent unreachable``, ``agent reachable
    again``), however many calls retry in between, and wake :attr:`changed`. A 401 or 403 to a
    claim call, or :meth:`check_token`'s verdict, is kept in :attr:`token_problem`, which
    :meth:`readiness` reports."""

    def __init__(self, socket: Path, token_file: Path, *,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        self.socket = socket
        self.tokens = TokenFile(token_file)
        self._claim_timeout_s = claim_timeout_s
        self._http = UnixHttp(str(socket), limit=MAX_CONNECTIONS)
        #: None until the first call ends; then whether the last one was answered.
        self.reachable: bool | None = None
        self._away_since: float | None = None
        #: Why the agent refuses the token (a readiness reason), or None.
        self.token_problem: str | None = None
        #: Set when the agent comes back, or refuses the token of a claim call: what
        #: :func:`agent.kubeplugin.credentials.check_agent_token` waits for.
        self.changed = asyncio.Event()

    def _answered(self) -> None:
        if self.reachable is False:
            away = None if self._away_since is None else time.monotonic() - self._away_since
            log.info("agent reachable again", extra={
                "socket": str(self.socket),
                "away_s": round(away, 1) if away is not None else None})
            self.changed.set()
        self.reachable, self._away_since = True, None

    def _unreachable(self, reason: str) -> None:
        if self.reachable is not False:
            log.warning("agent unreachable", extra={"socket": str(self.socket),
                                                    "error": reason, "hint": UNREACHABLE_HINT})
            self._away_since = time.monotonic()
        self.reachable = False

    def _refused_token(self, status: int, answer: Any) -> None:
        """A claim call answered 401 or 403: the token, not the claim, is what is wrong."""
        problem = answer if isinstance(answer, dict) else {}
        self.refuse_token(token_refusal(self.tokens.path, status,
                                        str(problem.get("detail") or f"HTTP {status}")))

    def refuse_token(self, problem: str | None) -> None:
        """Record what is wrong with the token (None: nothing), one log line per change."""
        if problem == self.token_problem:
            return
        if problem is not None:
            log.error("agent token refused", extra={"token_file": str(self.tokens.path),
                                                    "problem": problem})
        elif self.token_problem is not None:
            log.info("agent accepts the token again", extra={
                "token_file": str(self.tokens.path)})
        first = problem is not None and self.token_problem is None
        self.token_problem = problem
        if first:
            self.changed.set()

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
            reason = (f"agent socket {self.socket}: no answer to {method} {path} within "
                      f"{timeout_s:.0f} s")
            self._unreachable(reason)
            raise AgentUnreachable(reason) from err
        except OSError as err:
            reason = f"agent socket {self.socket}: {err}"
            self._unreachable(reason)
            raise AgentUnreachable(reason) from err
        self._answered()
        if auth and response.status in (401, 403):  # the agent's only 401s and 403s
            self._refused_token(response.status, _decoded(response.body))
        return response.status, response.headers, _decoded(response.body)

    @staticmethod
    def _raise(status: int, headers: Mapping[str, str], answer: Any) -> NoReturn:
        problem = answer if isinstance(answer, dict) else {}
        if status == 503:
            detail = str(problem.get("detail") or problem.get("title")
                         or reasons.AGENT_NOT_READY.text)
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

    async def imex_address(self) -> str | None:
        """This node's IMEX address as the agent is configured (``GET /v1/node``, ``imex``);
        None when the agent runs no IMEX."""
        status, headers, answer = await self._call("GET", "/v1/node", timeout_s=READY_TIMEOUT_S)
        if status != 200 or not isinstance(answer, dict):
            self._raise(status, headers, answer)
        imex = answer.get("imex")
        address = imex.get("address") if isinstance(imex, dict) else None
        return address if isinstance(address, str) and address else None

    async def configure_domain(self, domain: str, peers: list[str | None]) -> None:
        """``PUT /v1/domains/{domain}``: the domain's IMEX node list on this node, by seat
        (None: a seat no node holds now)."""
        status, headers, answer = await self._call(
            "PUT", f"/v1/domains/{quote(domain, safe='')}", body={"peers": peers},
            timeout_s=self._claim_timeout_s)
        if status not in (200, 201):
            self._raise(status, headers, answer)

    async def leave_domain(self, domain: str) -> None:
        """``DELETE /v1/domains/{domain}``: forget a domain no claim holds on this node (an
        unknown one is a success)."""
        status, headers, answer = await self._call(
            "DELETE", f"/v1/domains/{quote(domain, safe='')}", timeout_s=self._claim_timeout_s)
        if status not in (200, 204, 404):
            self._raise(status, headers, answer)

    async def domain(self, domain: str) -> dict[str, Any] | None:
        """``GET /v1/domains/{domain}``: the domain as this node's agent sees it (its IMEX
        daemon, nodes and state); None when the agent has no such domain."""
        status, headers, answer = await self._call(
            "GET", f"/v1/domains/{quote(domain, safe='')}", timeout_s=READY_TIMEOUT_S)
        if status == 404:
            return None
        if status != 200 or not isinstance(answer, dict):
            self._raise(status, headers, answer)
        result: dict[str, Any] = answer
        return result

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

    async def check_token(self) -> TokenCheck:
        """``GET /v1/whoami`` with the token: whether the agent accepts it with the ``claims``
        scope (an agent without the route, before 0.2, cannot say: no problem). The verdict
        is kept (:meth:`refuse_token`); :class:`AgentUnreachable` when there is no answer,
        :class:`TokenFileError` when the file cannot be used."""
        status, _, answer = await self._call("GET", "/v1/whoami", timeout_s=READY_TIMEOUT_S)
        body = answer if isinstance(answer, dict) else {}
        if status == 200:
            scopes = {str(s) for s in body.get("scopes") or []}
            name = str(body.get("name", ""))
            if scopes & {"claims", "admin"}:
                self.refuse_token(None)
                return TokenCheck(None, name)
            check = TokenCheck(token_refusal(
                self.tokens.path, 403, f"the agent's token {name!r} lacks the 'claims' scope "
                f"(it holds {', '.join(sorted(scopes)) or 'none'})"), name)
            self.refuse_token(check.problem)
            return check
        if status in (401, 403):  # kept by _call already
            return TokenCheck(self.token_problem)
        # 404: an agent that cannot check a token (the first prepare will tell).
        return TokenCheck(None)

    async def readiness(self) -> str | None:
        """None when the agent answers ``/readyz`` 200 and has not refused the token; else
        why not (unreachable, the token refused, or the agent's own reason for not being
        ready)."""
        try:
            status, _, answer = await self._call("GET", "/readyz", timeout_s=READY_TIMEOUT_S,
                                                 auth=False)
        except AgentUnreachable as err:
            return reasons.AGENT_UNREACHABLE.says(f"{err.reason}; {UNREACHABLE_HINT}")
        if self.token_problem is not None:
            # Checked again by every round while refused: a fixed token file shows at once.
            try:
                await self.check_token()
            except AgentUnreachable as err:
                return reasons.AGENT_UNREACHABLE.says(f"{err.reason}; {UNREACHABLE_HINT}")
            except TokenFileError as err:
                self.refuse_token(reasons.AGENT_TOKEN_FILE.says(str(err)))
            if self.token_problem is not None:
                return self.token_problem
        if status == 200:
            return None
        reason = answer.get("reason") or answer.get("detail") if isinstance(answer, dict) \
            else None
        return f"{reasons.AGENT_NOT_READY} (HTTP {status})" + (f": {reason}" if reason else "")

    async def ready(self) -> bool:
        """Whether the agent answers and is ready."""
        return await self.readiness() is None

    async def close(self) -> None:
        """Close the connections to the agent (a later call opens new ones)."""
        self._http.close()


def _decoded(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {"detail": body[:500].decode(errors="replace")}


def token_refusal(path: Path, status: int, detail: str) -> str:
    """The readiness reason of a token the agent refuses: the file, the agent's words, what
    to do (never the token)."""
    return reasons.AGENT_TOKEN_REFUSED.says(
        f"HTTP {status} for the token in {path}: {detail}; put the plugin's token (the "
        "token field of a 'name:token:claims' line of the agent's token file) in that file")


def token_file_usable(path: Path) -> str | None:
    """Why the token file at ``path`` cannot be used at start-up, or None."""
    try:
        TokenFile(path).token()
    except TokenFileError as err:
        return str(err)
    return None
