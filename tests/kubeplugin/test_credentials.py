"""What the plugin reads from its API server token (credentials.py), without a server: a
token bound to a Node is told from one bound to a Pod (which names its node too) or a
Secret; each change of verdict is one log line, a repeated refusal none; a Node seen with
another UID foretells the token's end, and the 401 that follows keeps the same reason."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest

from agent.kubeplugin import reasons
from agent.kubeplugin.credentials import ApiCredential, NodeBinding, node_binding, token_claims
from tests.kubeplugin.conftest import NODE
from tests.kubeplugin.plugin_run import node_bound_jwt

SOURCE = "the token of kubeconfig /etc/gpu-agent/kubelet-plugin.kubeconfig (user plugin)"


def jwt(claims: dict[str, Any]) -> str:
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


NODE_REF = {"name": NODE, "uid": "n-1"}
ACCOUNT = {"name": "gpu-node-agent", "uid": "sa-1"}


@pytest.mark.parametrize(("token", "binding"), [
    (jwt({"kubernetes.io": {"namespace": "gpu-node-agent", "node": NODE_REF,
                            "serviceaccount": ACCOUNT}}),
     NodeBinding(NODE, "n-1", "gpu-node-agent", "gpu-node-agent")),
    # Bound to a Pod: since 1.32 it names the pod's node as well; it dies with the pod.
    (jwt({"kubernetes.io": {"namespace": "gpu-node-agent", "node": NODE_REF,
                            "pod": {"name": "p", "uid": "p-1"}, "serviceaccount": ACCOUNT}}),
     None),
    (jwt({"kubernetes.io": {"namespace": "ns", "secret": {"name": "s", "uid": "s-1"},
                            "serviceaccount": ACCOUNT}}), None),
    (jwt({"kubernetes.io": {"namespace": "ns", "serviceaccount": ACCOUNT}}), None),
    ("0123456789abcdef", None),
    ("a.!!!.c", None),
])
def test_a_node_bound_token_is_told_apart(token: str, binding: NodeBinding | None) -> None:
    assert node_binding(token_claims(token)) == binding


def credential(token: str) -> ApiCredential:
    return ApiCredential(source=SOURCE, node_name=NODE, token=lambda: token)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agent.kubeplugin.credentials"]


def test_each_change_of_verdict_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """401 three times: one reason, one line; an answer again: cleared, one line; a 403 to
    the Node read, then the Node read fine: one line each."""
    caplog.set_level(logging.INFO, logger="agent.kubeplugin.credentials")
    cred = credential("opaque")
    for _ in range(3):
        cred.unauthenticated("401 Unauthorized")
    assert cred.problem is not None
    assert reasons.classify("checks.api_server", cred.problem) is reasons.API_CREDENTIAL_REFUSED
    assert SOURCE in cred.problem and "opaque" not in cred.problem
    cred.authenticated()
    assert cred.problem is None
    cred.forbidden("403 Forbidden: nodes is forbidden")
    cred.authenticated()  # another call answering does not lift a missing role
    assert cred.problem is not None and "ClusterRole" in cred.problem
    cred.saw_node({"metadata": {"name": NODE, "uid": "n-1"}})
    assert cred.problem is None
    assert refusals(caplog) == ["api server credential refused",
                                "api server accepts the credential again",
                                "api server credential refused",
                                "api server accepts the credential again"]


def test_an_expired_token_says_when(caplog: pytest.LogCaptureFixture) -> None:
    cred = credential(jwt({"exp": 1_700_000_000, "sub": "x"}))
    cred.unauthenticated("401 Unauthorized")
    assert cred.problem is not None and "expired at 2023-11-14T22:13:20+00:00" in cred.problem


def test_a_re_registered_node_foretells_the_401(caplog: pytest.LogCaptureFixture) -> None:
    """The Node read with a new UID is "Node-bound credential dead" at once; the 401 that
    follows keeps it, without a second line; a token for the new UID clears it."""
    caplog.set_level(logging.INFO, logger="agent.kubeplugin.credentials")
    token = node_bound_jwt(NODE, "uid-old")
    cred = ApiCredential(source=SOURCE, node_name=NODE, token=lambda: token)
    cred.saw_node({"metadata": {"name": NODE, "uid": "uid-old"}})
    assert cred.problem is None
    cred.saw_node({"metadata": {"name": NODE, "uid": "uid-new"}})
    foretold = cred.problem
    assert foretold is not None and "is now uid uid-new" in foretold
    assert reasons.classify("checks.api_server", foretold) is reasons.NODE_CREDENTIAL_DEAD
    cred.unauthenticated("401 Unauthorized")
    cred.unauthenticated("401 Unauthorized")
    assert cred.problem == foretold
    token = node_bound_jwt(NODE, "uid-new")
    cred.authenticated()
    cred.saw_node({"metadata": {"name": NODE, "uid": "uid-new"}})
    assert cred.problem is None
    assert refusals(caplog) == ["api server credential refused",
                                "api server accepts the credential again"]
