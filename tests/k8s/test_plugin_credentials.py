"""The kubelet plugin's API server credential against the real kube-apiserver (issue 24): a
token the server does not know (401) and a ServiceAccount without the plugin's role (403)
are each "API server credential refused", never "unreachable"; a token bound to the Node
(bare metal) dies when the Node is deleted and registered again, and after the server's token
cache lets go (10 s) the plugin says "Node-bound credential dead" with the command that
renews it; the renewed token written into the kubeconfig is used without a restart.

The plugin is the real process with the real Kubernetes wiring (its publisher left out);
each test has Nodes and accounts of its own on the session's shared server."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.kubeplugin import reasons
from tests.k8s.harness import ApiServer
from tests.kubeplugin.conftest import write_private
from tests.kubeplugin.plugin_run import kubeconfig, start_plugin

NAMESPACE = "plugin-credentials"
#: What the plugin needs for its start-up check: a get of its own Node.
ROLE = "plugin-credentials-nodes"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: the plugin's Unix sockets go under it."""
    path = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _account(server: ApiServer, name: str, *, role: bool) -> None:
    """ServiceAccount ``name`` in NAMESPACE, bound to ``nodes get`` when ``role``."""
    if server.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        server.kubectl("create", "namespace", NAMESPACE)
    if server.kubectl("get", "serviceaccount", "-n", NAMESPACE, name,
                      check=False).returncode != 0:
        server.kubectl("create", "serviceaccount", "-n", NAMESPACE, name)
    if role:
        if server.kubectl("get", "clusterrole", ROLE, check=False).returncode != 0:
            server.kubectl("create", "clusterrole", ROLE, "--verb=get", "--resource=nodes")
        server.kubectl("create", "clusterrolebinding", f"{ROLE}-{name}",
                       f"--clusterrole={ROLE}", f"--serviceaccount={NAMESPACE}:{name}")


def _node_bound_token(server: ApiServer, account: str, node: str) -> str:
    return server.kubectl("create", "token", "-n", NAMESPACE, account, "--duration=1h",
                          "--bound-object-kind=Node",
                          f"--bound-object-name={node}").stdout.strip()


def test_an_unknown_token_and_a_missing_role_are_refused_credentials(
        kube_apiserver: ApiServer, short_dir: Path) -> None:
    """401 for a token the server never issued, 403 for a ServiceAccount without the role:
    each "API server credential refused" naming the kubeconfig, one log line each."""
    server = kube_apiserver
    node = f"cred-{secrets.token_hex(3)}"
    server.ensure_node(node)
    _account(server, "no-role", role=False)
    no_role = server.kubectl("create", "token", "-n", NAMESPACE, "no-role",
                             "--duration=1h").stdout.strip()
    for case, token, status in (("unknown", secrets.token_hex(16), "HTTP 401"),
                                ("no-role", no_role, "HTTP 403")):
        root = short_dir / case
        root.mkdir()
        config = kubeconfig(root / "kubeconfig", server.url, token, ca=server.ca)
        run = start_plugin(root, socket=root / "agent.sock",
                           token_file=write_private(root / "plugin.token", "t\n"),
                           kubeconfig=config, real_kubernetes=True, node=node)
        try:
            found = run.wait_check("api_server", reasons.API_CREDENTIAL_REFUSED.text, 60)
            assert status in found and str(config) in found, found
            if case == "no-role":
                assert "ClusterRole gpu-node-agent-kubelet-plugin" in found, found
            run.readyz()
            run.wait_logged("api server credential refused")  # its reader thread may lag
            assert run.count("api server credential refused") == 1, run.output()
            assert token not in run.output()
        finally:
            run.stop()


def test_a_node_bound_token_dies_with_its_node_and_is_renewed(kube_apiserver: ApiServer,
                                                             short_dir: Path) -> None:
    """With a token bound to its Node the plugin's check is ok; the Node deleted and created
    again (a new UID), the server refuses the token once its cache lets go and the plugin
    says "Node-bound credential dead" with the renewal command, one log line; a token bound
    to the new Node written into the kubeconfig makes the check ok again, without a
    restart."""
    server = kube_apiserver
    node = f"cred-{secrets.token_hex(3)}"
    old_uid = server.ensure_node(node)["metadata"]["uid"]
    _account(server, "node-bound", role=True)
    token = _node_bound_token(server, "node-bound", node)
    config = kubeconfig(short_dir / "kubeconfig", server.url, token, ca=server.ca)
    run = start_plugin(short_dir, socket=short_dir / "agent.sock",
                       token_file=write_private(short_dir / "plugin.token", "t\n"),
                       kubeconfig=config, real_kubernetes=True, node=node)
    try:
        run.wait_check("api_server", "ok", 60)

        server.kubectl("delete", "node", node)
        new_uid = server.ensure_node(node)["metadata"]["uid"]
        assert new_uid != old_uid
        found = run.wait_check("api_server", reasons.NODE_CREDENTIAL_DEAD.text, 90)
        renew = (f"kubectl -n {NAMESPACE} create token node-bound --bound-object-kind=Node "
                 f"--bound-object-name={node} --duration=720h")
        for words in (renew, f"uid {old_uid}", str(config), "HTTP 401"):
            assert words in found, found
        run.readyz()
        run.wait_logged("api server credential refused")  # its reader thread may lag
        assert run.count("api server credential refused") == 1, run.output()
        assert token not in run.output()

        renewed = _node_bound_token(server, "node-bound", node)
        kubeconfig(config, server.url, renewed, ca=server.ca)
        run.wait_check("api_server", "ok", 60)
        run.wait_logged("api server accepts the credential again")  # its reader thread may lag
        assert run.count("api server accepts the credential again") == 1, run.output()
        assert renewed not in run.output()
    finally:
        run.stop()
        server.kubectl("delete", "node", node, check=False)
