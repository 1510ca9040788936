"""The plugin's two credentials, checked before they are needed.

- **The agent token** (``--token-file``): at start, and again whenever the agent comes back
  or refuses a claim call's token, the plugin asks ``GET /v1/whoami`` whether the agent
  accepts it with the ``claims`` scope (:func:`follow_agent_token`). Reads need no token
  unless the agent runs with ``--auth-read``, so without this a wrong token would show only
  at the first prepare.
- **The API server credential** (the in-cluster ServiceAccount token, or ``--kubeconfig``):
  at start the plugin reads its own Node once (:func:`follow_api_credential`), a call that
  needs both a valid credential and the RBAC of its role; any 401 later, on any call, marks
  the credential refused (:class:`ApiCredential`).

A refusal is a readiness reason naming the credential and one log line; while it stands the
check is repeated every :data:`RECHECK_S`, so a renewed credential is noticed without a
restart (a kubeconfig's token is read again when the file changes), and one more log line
says it is accepted again.

A token bound to a Node (bare metal: ``kubectl create token --bound-object-kind=Node``)
dies with that Node object: a Node deleted and registered again has a new UID, and the API
server refuses every token bound to the old one once its token cache lets go. The token's
own claims say what it is bound to (it is a JWT; read here, never verified: the server
decides), so that case has its own reason, naming the command that renews it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from agent.kubeplugin import reasons
from agent.kubeplugin.errors import AgentUnreachable, TokenFileError

log = logging.getLogger("agent.kubeplugin.credentials")

#: How often a refused credential is checked again (renewed: accepted within this long).
RECHECK_S = 10.0
#: Backoff while there is no answer at all (the agent or the API server away).
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0
#: The plugin's ClusterRole (daemonset/base/rbac.yaml), named in a 403's reason.
PLUGIN_ROLE = "gpu-node-agent-kubelet-plugin"
RENEW_DOC = 'docs/kubernetes.md, "Renewing a Node-bound credential"'


# -- what a token says about itself -------------------------------------------------------

def token_claims(token: str) -> dict[str, Any] | None:
    """The claims of a JWT (unverified), or None when ``token`` is not one."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (binascii.Error, ValueError):
        return None
    return claims if isinstance(claims, dict) else None


@dataclass(frozen=True)
class NodeBinding:
    """A ServiceAccount token bound to a Node object (not to a Pod or a Secret)."""

    node: str
    uid: str
    namespace: str
    service_account: str

    def renew_command(self) -> str:
        return (f"kubectl -n {self.namespace} create token {self.service_account} "
                f"--bound-object-kind=Node --bound-object-name={self.node} --duration=720h")


def node_binding(claims: Mapping[str, Any] | None) -> NodeBinding | None:
    """What a token's claims bind it to, when that is a Node (``kubernetes.io.node`` without
    ``pod`` or ``secret``: a pod-bound token names its pod's node too, since 1.32)."""
    kube = claims.get("kubernetes.io") if claims else None
    if not isinstance(kube, dict) or "pod" in kube or "secret" in kube:
        return None
    node, account = kube.get("node"), kube.get("serviceaccount")
    if not isinstance(node, dict) or not node.get("name"):
        return None
    account = account if isinstance(account, dict) else {}
    return NodeBinding(node=str(node["name"]), uid=str(node.get("uid", "")),
                       namespace=str(kube.get("namespace", "NAMESPACE")),
                       service_account=str(account.get("name", "SERVICEACCOUNT")))


def _expired(claims: Mapping[str, Any] | None) -> str | None:
    """When the token expired (ISO 8601), if it has."""
    expiry = claims.get("exp") if claims else None
    if not isinstance(expiry, int | float) or expiry > time.time():
        return None
    return datetime.fromtimestamp(expiry, UTC).isoformat(timespec="seconds")


# -- the API server credential -------------------------------------------------------------

class ApiCredential:
    """The API server credential of the plugin's clients (one for all: siblings share it):
    where it comes from, in words (``source``), and why the server refuses it
    (:attr:`problem`, a readiness reason), if it does.

    ``token`` answers the bearer token now in use (None: the credential is a client
    certificate or an exec plugin's, which says nothing about its binding)."""

    def __init__(self, *, source: str, node_name: str,
                 token: Callable[[], str | None] = lambda: None) -> None:
        self.source = source
        self.node_name = node_name
        self._token = token
        self.problem: str | None = None
        #: "unauthenticated" (401: any answer clears it), "forbidden" or "not_found" (the
        #: Node read: cleared by the next good read), "node_moved" (the Node's UID is not
        #: the token's: cleared when the token or the Node agree again).
        self._kind: str | None = None
        self._node_uid: str | None = None
        #: Set when a problem appears: :func:`follow_api_credential` checks again.
        self.changed = asyncio.Event()

    def _claims(self) -> dict[str, Any] | None:
        token = self._token()
        return token_claims(token) if token else None

    def binding(self) -> NodeBinding | None:
        """What the current token is bound to, when it is a Node."""
        return node_binding(self._claims())

    def _set(self, kind: str | None, problem: str | None) -> None:
        if problem == self.problem:
            self._kind = kind
            return
        if problem is not None:
            log.error("api server credential refused", extra={
                "credential": self.source, "problem": problem})
            self.changed.set()
        else:
            log.info("api server accepts the credential again",
                     extra={"credential": self.source})
        self._kind, self.problem = kind, problem

    def _dead(self, binding: NodeBinding, why: str, *, expired: str | None = None) -> str:
        cause = (f"it expired at {expired}" if expired else "a Node deleted and registered "
                 "again has a new uid, which ends every token bound to the old one")
        return reasons.NODE_CREDENTIAL_DEAD.says(
            f"{self.source} is bound to Node {binding.node} (uid {binding.uid}); {why}: "
            f"{cause}. Renew it with '{binding.renew_command()}' and write it into the "
            f"kubeconfig ({RENEW_DOC})")

    def unauthenticated(self, detail: str) -> None:
        """The server answered 401: the credential itself is refused."""
        claims = self._claims()
        binding = node_binding(claims)
        expired = _expired(claims)
        if binding is not None:
            if (self.problem or "").startswith(reasons.NODE_CREDENTIAL_DEAD.text):
                self._kind = "unauthenticated"  # foretold: the same reason, no new line
                return
            now = (f"; Node {binding.node} is now uid {self._node_uid}"
                   if self._node_uid and self._node_uid != binding.uid else "")
            self._set("unauthenticated", self._dead(
                binding, f"the API server refuses it (HTTP 401: {detail}){now}",
                expired=expired))
            return
        self._set("unauthenticated", reasons.API_CREDENTIAL_REFUSED.says(
            f"HTTP 401 for {self.source}: {detail}"
            + (f"; the token expired at {expired}" if expired else "")
            + "; give the plugin a valid credential for the API server"))

    def authenticated(self) -> None:
        """The server answered a call: whatever a 401 said no longer holds."""
        if self._kind == "unauthenticated":
            self._set(None, None)

    def forbidden(self, detail: str) -> None:
        """Reading its own Node answered 403: the identity lacks its role."""
        self._set("forbidden", reasons.API_CREDENTIAL_REFUSED.says(
            f"HTTP 403 for {self.source}: {detail}; bind its ServiceAccount to the "
            f"ClusterRole {PLUGIN_ROLE} (daemonset/base/rbac.yaml)"))

    def node_missing(self) -> None:
        """Reading its own Node answered 404."""
        self._set("not_found", reasons.NODE_NOT_FOUND.says(
            f"GET /api/v1/nodes/{self.node_name} answered 404: is --node-name (NODE_NAME) "
            "kubelet's node name, and is kubelet registered?"))

    def saw_node(self, node: Mapping[str, Any]) -> None:
        """The Node as the server has it now: a token bound to an older Node of the same name
        is dead already, though the server may accept it for a few seconds more."""
        uid = str(node.get("metadata", {}).get("uid", ""))
        self._node_uid = uid or self._node_uid
        binding = self.binding()
        if binding is not None and binding.node == self.node_name and uid \
                and binding.uid and binding.uid != uid:
            if not (self.problem or "").startswith(reasons.NODE_CREDENTIAL_DEAD.text):
                self._set("node_moved", self._dead(
                    binding, f"Node {binding.node} is now uid {uid}, so the API server "
                    "refuses it once its token cache lets go"))
            return
        if self._kind in ("forbidden", "not_found", "node_moved"):
            self._set(None, None)


class CredentialProbe(Protocol):
    """The call that checks the API server credential (``KubeClient``), and the reload of
    a credential rewritten in its file."""

    credential: ApiCredential | None

    async def check_credential(self) -> None: ...

    async def reload_credential(self) -> None: ...


async def follow_api_credential(probe: CredentialProbe) -> None:
    """Check the API server credential once at start, then again while it is refused (or
    whenever a call finds it refused), until cancelled. No answer at all is retried with
    backoff and left to the readiness check's "API server unreachable"."""
    credential = probe.credential
    assert credential is not None
    delay = RETRY_FIRST_S
    while True:
        credential.changed.clear()
        try:
            await probe.check_credential()
        except Exception as err:  # no answer (KubeUnavailable, ...): try again later
            log.debug("api server credential check got no answer", extra={"error": str(err)})
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        delay = RETRY_FIRST_S
        # A renewed credential is picked up before the old one runs out: the file is looked
        # at (a stat) every RECHECK_S, and checked again while refused.
        while not await _wait(credential.changed, RECHECK_S) \
                and credential.problem is None:
            await probe.reload_credential()


# -- the agent token ----------------------------------------------------------------------

class TokenChecking(Protocol):
    """What :func:`follow_agent_token` needs of the agent client (``AgentClient``)."""

    token_problem: str | None
    changed: asyncio.Event

    async def check_token(self) -> Any: ...

    def refuse_token(self, problem: str | None) -> None: ...


async def follow_agent_token(agent: TokenChecking) -> None:
    """Check the agent token once the agent answers, again each time it comes back (it may
    have restarted with another token file), and every :data:`RECHECK_S` while refused,
    until cancelled. While the agent is away its calls log that (once)."""
    delay = RETRY_FIRST_S
    while True:
        agent.changed.clear()
        try:
            await agent.check_token()
        except AgentUnreachable:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        except TokenFileError as err:
            agent.refuse_token(reasons.AGENT_TOKEN_FILE.says(str(err)))
        delay = RETRY_FIRST_S
        if agent.token_problem is not None:
            await _wait(agent.changed, RECHECK_S)
        else:
            await agent.changed.wait()


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    return False
