"""A small synchronous client for the agent's API, over TCP or the Unix socket."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent.settings import DEFAULT_SOCKET, SIM_STATE_DIR
from agent.token_file import first_token


class ClientError(Exception):
    """A one-line message for the terminal; ``status`` and ``problem`` (the problem+json body)
    when the agent answered with an error. This class: the agent refused or failed the
    request; each subclass is another kind of failure, with its own exit status."""

    #: The CLI's exit status for this kind of failure (listed in ``gpu-agent --help``).
    exit_code = 1

    def __init__(self, message: str, *, status: int | None = None,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem or {}


class UsageError(ClientError):
    """The command line is wrong (a malformed URL, a malformed argument): exit 2, as
    argparse's own usage errors."""

    exit_code = 2


class AgentUnreachable(ClientError):
    """Nothing answers at the agent's address (not running, wrong URL, no socket)."""

    exit_code = 3


class CredentialsRefused(ClientError):
    """The credentials cannot be read or the agent refuses them: the token file, the TLS
    files, a 401 or 403, a TLS handshake that fails."""

    exit_code = 4


#: ``gpu-agent --help``'s epilog: what each exit status of a client verb means.
EXIT_CODES = """\
exit status of the client verbs: 0 done; 1 the agent refused or failed the request (its
problem, in one line); 2 the command line is wrong (usage, a malformed --url); 3 the agent
cannot be reached (not running, wrong --url, no socket); 4 the credentials are unreadable or
refused (--token-file, the TLS files, 401, 403). Each error is one line on stderr (a usage
error adds the usage)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass(frozen=True)
class Response:
    status: int
    body: Any


def read_token_file(path: Path) -> str:
    """The token of the first line that has one: the token alone (as the kubelet plugin's
    Secret holds it) or the agent's own ``name:token[:scopes]`` line, whose second field is the
    token. ``#`` lines are comments. A file with no token is a :class:`CredentialsRefused`."""
    token = first_token(path.read_text())
    if token is not None:
        return token
    raise CredentialsRefused(f"token file {path} holds no token: put the token alone on a "
                             "line, or a 'name:token[:scopes]' line")


def _sendable(token: str, source: str) -> str:
    """``token`` if an HTTP header can carry it (printable ASCII), else one line naming the
    source to fix (http.client would raise deep inside the request otherwise)."""
    if token.isascii() and token.isprintable():
        return token
    raise CredentialsRefused(f"the token in {source} holds characters a bearer token cannot "
                             "carry (only printable ASCII): give the token the agent issued")


def normalise_url(url: str) -> str:
    """``unix:PATH``, ``http(s)://HOST:PORT``, or ``HOST:PORT`` (taken as ``http://``, as curl
    does); anything else is a :class:`UsageError` saying the URL is malformed."""
    if url.startswith("unix:"):
        if not url[5:]:
            raise UsageError("malformed URL 'unix:': give the socket path, e.g. "
                             "unix:/run/gpu-agent/agent.sock")
        return url
    if url.startswith("/"):
        return f"unix:{url}"
    full = url if "://" in url else f"http://{url}"
    try:
        parts = urlsplit(full)
        port = parts.port
    except ValueError:  # an unclosed IPv6 bracket, a port that is no number
        port = -1
    if port == -1 or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or not full.isprintable():
        raise UsageError(f"malformed URL {url[:200]!r}: expected http(s)://HOST:PORT, "
                         "HOST:PORT or unix:PATH")
    return full.rstrip("/")


def discover(url: str | None, token_file: str | None) -> tuple[str, str | None]:
    """Where to connect and with which token: flags, then ``GPU_AGENT_URL`` /
    ``GPU_AGENT_TOKEN[_FILE]``, then a simulated agent started from this directory, then the
    node's default socket."""
    url = url or os.environ.get("GPU_AGENT_URL")
    token_path = token_file or os.environ.get("GPU_AGENT_TOKEN_FILE")
    token = os.environ.get("GPU_AGENT_TOKEN")
    source = "GPU_AGENT_TOKEN"
    sim_dir = SIM_STATE_DIR.absolute()
    if url is None and (sim_dir / "listeners.json").exists():
        url = f"unix:{sim_dir / 'agent.sock'}"
        if token_path is None and token is None and (sim_dir / "tokens").exists():
            token_path = str(sim_dir / "tokens")
    if token_path is not None:
        source = f"token file {token_path}"
        try:
            token = read_token_file(Path(token_path))
        except OSError as err:
            raise CredentialsRefused(f"cannot read token file {token_path}: {err.strerror} "
                                     "(pass --token-file FILE, or set GPU_AGENT_TOKEN_FILE)"
                                     ) from err
        except UnicodeDecodeError as err:
            raise CredentialsRefused(f"token file {token_path} is not text: give the file "
                                     "that holds the token") from err
    return normalise_url(url or DEFAULT_SOCKET), token and _sendable(token, source)


def tls_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The TLS settings for an ``https://`` agent: a CA to trust instead of the system's, and a
    client certificate for an agent started with ``--tls-client-ca``; None for the defaults.
    Flags first, then ``GPU_AGENT_CACERT`` / ``GPU_AGENT_CERT`` / ``GPU_AGENT_KEY``."""
    cacert = cacert or os.environ.get("GPU_AGENT_CACERT")
    cert = cert or os.environ.get("GPU_AGENT_CERT")
    key = key or os.environ.get("GPU_AGENT_KEY")
    if cacert is None and cert is None:
        if key is not None:
            raise UsageError("--key needs --cert")
        return None
    try:
        context = ssl.create_default_context(cafile=cacert)
        if cert is not None:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise CredentialsRefused(f"cannot load the TLS files: {reason}") from err
    return context


class AgentClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        self.token = token
        self.timeout = timeout
        self.tls = tls

    def _connection(self) -> http.client.HTTPConnection:
        if self.url.startswith("unix:"):
            return _UnixConnection(self.url[5:], self.timeout)
        parts = urlsplit(self.url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.hostname or "localhost", parts.port,
                                               timeout=self.timeout, context=self.tls)
        return http.client.HTTPConnection(parts.hostname or "localhost", parts.port or 80,
                                          timeout=self.timeout)

    def request(self, method: str, path: str, body: Any = None, *,
                text: bool = False) -> Response:
        """Send one request; raise :class:`ClientError` for transport errors and problems. A
        success must be JSON, as every agent answer is, unless ``text`` (``/metrics``)."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        conn = self._connection()
        try:
            conn.request(method, path, body=data, headers=headers)
            raw = conn.getresponse()
            payload = raw.read()
        except ssl.SSLError as err:
            reason = getattr(err, "reason", None) or str(err)
            raise CredentialsRefused(
                f"TLS with the agent at {self.url} failed: {reason} (pass --cacert with the CA "
                "that signed its certificate, and --cert/--key if it asks for a client "
                "certificate)") from err
        except (OSError, http.client.HTTPException) as err:
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise AgentUnreachable(f"cannot reach the agent at {self.url}: {reason} (is it "
                                   "running? start it with 'gpu-agent serve', or pass --url)"
                                   ) from err
        finally:
            conn.close()
        try:
            parsed = json.loads(payload) if payload else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            parsed = payload.decode(errors="replace")
        if raw.status >= 400:
            raise self._refusal(raw.status, raw.reason, parsed)
        if isinstance(parsed, str) and not text:
            raise AgentUnreachable(f"{self.url} answered {method} {path} with something other "
                                   "than JSON: it is not a gpu-agent (pass the agent's --url)")
        return Response(raw.status, parsed)

    def _refusal(self, status: int, reason: str, parsed: Any) -> ClientError:
        """An error answer as one line; for 401 and 403, what to pass instead."""
        kind = CredentialsRefused if status in (401, 403) else ClientError
        if not (isinstance(parsed, dict) and "detail" in parsed):
            return kind(f"{status} {reason}", status=status)
        detail = " ".join(str(parsed["detail"]).split())  # one line, whatever the agent sent
        if status == 401:
            detail = ("the agent does not know this token: pass --token-file with one of the "
                      "tokens in the agent's own --token-file" if self.token else
                      "this needs a token: pass --token-file FILE (the token alone, or a "
                      "'name:token[:scopes]' line), or set GPU_AGENT_TOKEN_FILE")
        elif status == 403 and parsed.get("scope"):
            detail += f"; pass --token-file with a token that has the {parsed['scope']!r} scope"
        return kind(f"{status} {parsed.get('title', reason)}: {detail}", status=status,
                    problem=parsed)
