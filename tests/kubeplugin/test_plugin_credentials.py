"""A plugin that says what is wrong (issue 24), as the real ``gpu-agent kubelet-plugin``
process: a configuration it cannot use is one line on stderr and exit 2; at start it checks
the agent token (``GET /v1/whoami``) and the API server credential (a read of its own Node),
and a refusal is its own ``/readyz`` reason naming the credential, one log line, and cleared
(one more line) once the credential is fixed; the agent going away and coming back is one
line each, however often the plugin retries. The API server here is a stand-in answering
what each case needs (tests/k8s/test_plugin_credentials.py meets the real one)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.kubeplugin import reasons
from tests.agent_process import AgentProcess, start_agent
from tests.kubeplugin.conftest import NODE, write_private
from tests.kubeplugin.plugin_run import (
    PluginRun,
    StandIn,
    kubeconfig,
    node_bound_jwt,
    serve,
    start_plugin,
)
from tests.waiting import wait_for

#: How many rounds of /readyz a test polls before counting log lines: each round calls the
#: agent and the API server again, as kubelet's probe does every 10 s.
ROUNDS = 4


def rounds(run: PluginRun, check: str) -> str:
    """``ROUNDS`` rounds of /readyz, the last one's reason for ``check``."""
    for _ in range(ROUNDS - 1):
        run.readyz()
    return run.check(check)


def agent_with_tokens(state: Path, lines: str) -> AgentProcess:
    """A simulated agent for NODE whose token file is ``lines`` (name:token[:scopes])."""
    state.mkdir(parents=True, exist_ok=True)
    write_private(state / "tokens", lines)
    return start_agent(state, extra=["--node-name", NODE, "--token-file", str(state / "tokens")])


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    yield from serve(StandIn(token=secrets.token_hex(16)))


# -- a configuration it cannot use ------------------------------------------------------------

@pytest.mark.parametrize(("case", "says"), [
    ("nothing", ["--kubeconfig", "KUBERNETES_SERVICE_HOST",
                 "/var/run/secrets/kubernetes.io/serviceaccount/token"]),
    ("missing", ["--kubeconfig", "no such file"]),
    ("directory", ["--kubeconfig", "not a file"]),
    ("empty", ["--kubeconfig", "not a usable kubeconfig"]),
    ("not yaml", ["--kubeconfig", "not a usable kubeconfig"]),
    ("no context", ["--kubeconfig", "not a usable kubeconfig"]),
])
def test_a_configuration_it_cannot_use_is_one_line_and_exit_2(short_dir: Path, case: str,
                                                                says: list[str]) -> None:
    """No in-cluster environment and no --kubeconfig, or a kubeconfig that is missing, not
    a file, empty, not YAML or without a current context: the real command exits 2 with one
    line on stderr naming what it looked for and what to give it, and no traceback."""
    config = short_dir / "kubeconfig"
    if case == "directory":
        config.mkdir()
    elif case == "empty":
        config.write_text("")
    elif case == "not yaml":
        config.write_text("apiVersion: [v1\n")
    elif case == "no context":
        config.write_text('{"apiVersion": "v1", "kind": "Config", "current-context": "x"}')
    token = write_private(short_dir / "plugin.token", "t\n")
    args = [sys.executable, "-m", "agent", "kubelet-plugin",
            "--agent-socket", str(short_dir / "agent.sock"), "--token-file", str(token),
            "--node-name", NODE, "--registry-dir", str(short_dir / "reg"),
            "--plugins-dir", str(short_dir / "plug"), "--health-listen", "127.0.0.1:0",
            *([] if case == "nothing" else ["--kubeconfig", str(config)])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-agent kubelet-plugin: "), lines
    for words in says:
        assert words in lines[0], lines[0]


# -- the API server credential ----------------------------------------------------------------

@pytest.mark.parametrize(("case", "reason", "says"), [
    ("wrong token", reasons.API_CREDENTIAL_REFUSED, ["HTTP 401", "the token of kubeconfig"]),
    ("no RBAC", reasons.API_CREDENTIAL_REFUSED,
     ["HTTP 403", "the token of kubeconfig", "ClusterRole gpu-node-agent-kubelet-plugin"]),
    ("no Node", reasons.NODE_NOT_FOUND, [f"/api/v1/nodes/{NODE}", "--node-name"]),
])
def test_a_refused_api_credential_is_its_own_reason_until_fixed(
        short_dir: Path, stand_in: StandIn, case: str, reason: reasons.Reason,
        says: list[str]) -> None:
    """A 401 (a token the server does not know), a 403 to the plugin's read of its own Node
    (a ServiceAccount without the plugin's role) and a 404 (no such Node) are each their own
    reason under checks.api_server, never "API server unreachable", naming the kubeconfig and
    the fix, with one log line however many rounds ask; fixed (a rewritten kubeconfig, the
    role, the Node), the check is ok again and one line says so. The token is never shown."""
    token = stand_in.token if case != "wrong token" else secrets.token_hex(16)
    if case == "no RBAC":
        stand_in.node = 403
    elif case == "no Node":
        stand_in.node = 404
    config = kubeconfig(short_dir / "kubeconfig", stand_in.url, token)
    run = start_plugin(short_dir, socket=short_dir / "agent.sock",
                       token_file=write_private(short_dir / "plugin.token", "t\n"),
                       kubeconfig=config, real_kubernetes=True)
    try:
        found = run.wait_check("api_server", reason.text)
        assert reasons.classify("checks.api_server", found) is reason
        for words in [*says, *([str(config)] if reason is not reasons.NODE_NOT_FOUND else [])]:
            assert words in found, found
        assert rounds(run, "api_server") == found
        run.wait_logged("api server credential refused")  # its reader thread may lag
        assert run.count("api server credential refused") == 1, run.output()
        assert token not in run.output() and token not in str(run.readyz())

        if case == "wrong token":
            kubeconfig(config, stand_in.url, stand_in.token)  # renewed: read again
        else:
            stand_in.node = {"apiVersion": "v1", "kind": "Node",
                             "metadata": {"name": NODE, "uid": "uid-1"}}
        run.wait_check("api_server", "ok")
        run.wait_logged("api server accepts the credential again")
        run.wait_logged("api server accepts the credential again")  # its reader thread may lag
        assert run.count("api server accepts the credential again") == 1, run.output()
        assert stand_in.token not in run.output()
    finally:
        run.stop()


def test_an_api_server_that_does_not_answer_is_unreachable(short_dir: Path) -> None:
    """No answer at all is "API server unreachable", and no credential is blamed."""
    config = kubeconfig(short_dir / "kubeconfig", "http://127.0.0.1:9", "t")
    run = start_plugin(short_dir, socket=short_dir / "agent.sock",
                       token_file=write_private(short_dir / "plugin.token", "t\n"),
                       kubeconfig=config, real_kubernetes=True)
    try:
        found = run.wait_check("api_server", reasons.API_UNREACHABLE.text)
        assert reasons.classify("checks.api_server", found) is reasons.API_UNREACHABLE
        assert run.count("api server credential refused") == 0
    finally:
        run.stop()


@pytest.mark.parametrize("case", ["refused", "re-registered"])
def test_a_dead_node_bound_credential_names_the_renewal(short_dir: Path, stand_in: StandIn,
                                                       case: str) -> None:
    """A token bound to this Node (bare metal) dies with the Node object: refused (401), or
    still accepted while the Node already has another UID (deleted and registered again; the
    server refuses it once its token cache lets go), it is "Node-bound credential dead" with
    the command that renews it, one log line, also when the 401 follows the foretelling."""
    token = node_bound_jwt(NODE, "uid-old")
    if case == "re-registered":
        stand_in.token = token  # accepted, for now
        stand_in.node = {"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": NODE, "uid": "uid-new"}}
    config = kubeconfig(short_dir / "kubeconfig", stand_in.url, token)
    run = start_plugin(short_dir, socket=short_dir / "agent.sock",
                       token_file=write_private(short_dir / "plugin.token", "t\n"),
                       kubeconfig=config, real_kubernetes=True)
    try:
        found = run.wait_check("api_server", reasons.NODE_CREDENTIAL_DEAD.text)
        assert reasons.classify("checks.api_server", found) is reasons.NODE_CREDENTIAL_DEAD
        renew = (f"kubectl -n gpu-node-agent create token gpu-node-agent "
                 f"--bound-object-kind=Node --bound-object-name={NODE} --duration=720h")
        for words in (renew, "uid uid-old", str(config), "Renewing a Node-bound credential"):
            assert words in found, found
        if case == "re-registered":
            assert "is now uid uid-new" in found, found
            stand_in.token = "the cache let go"  # now 401
        assert rounds(run, "api_server").startswith(reasons.NODE_CREDENTIAL_DEAD.text)
        run.wait_logged("api server credential refused")  # its reader thread may lag
        assert run.count("api server credential refused") == 1, run.output()
        assert token not in run.output()

        renewed = node_bound_jwt(NODE, "uid-new")
        stand_in.token = renewed
        stand_in.node = {"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": NODE, "uid": "uid-new"}}
        kubeconfig(config, stand_in.url, renewed)
        run.wait_check("api_server", "ok")
        run.wait_logged("api server accepts the credential again")
        run.wait_logged("api server accepts the credential again")  # its reader thread may lag
        assert run.count("api server accepts the credential again") == 1, run.output()
    finally:
        run.stop()


# -- the agent token ----------------------------------------------------------------------

@pytest.mark.parametrize(("case", "says"), [
    ("unknown token", ["HTTP 401", "invalid bearer token"]),
    ("read scope only", ["HTTP 403", "lacks the 'claims' scope"]),
])
def test_a_refused_agent_token_is_its_own_reason_until_fixed(short_dir: Path, case: str,
                                                             says: list[str]) -> None:
    """A token the agent does not know, or one without the ``claims`` scope, is "agent
    token refused" naming the token file, at start and before any prepare (it used to pass
    as ``checks.agent: ok``), with one log line; the right token written into the file makes
    the check ok again, with one more line. The token is never shown."""
    good, reader = secrets.token_hex(16), secrets.token_hex(16)
    agent = agent_with_tokens(short_dir / "state",
                              f"admin:{secrets.token_hex(16)}\nplugin:{good}:claims\n"
                              f"reader:{reader}:read\n")
    wrong = secrets.token_hex(16) if case == "unknown token" else reader
    token_file = write_private(short_dir / "plugin.token", wrong + "\n")
    run = start_plugin(short_dir, socket=agent.socket_path, token_file=token_file)
    try:
        found = run.wait_check("agent", reasons.AGENT_TOKEN_REFUSED.text)
        assert reasons.classify("checks.agent", found) is reasons.AGENT_TOKEN_REFUSED
        for words in [*says, str(token_file)]:
            assert words in found, found
        assert rounds(run, "agent") == found
        run.wait_logged("agent token refused")  # its reader thread may lag
        assert run.count("agent token refused") == 1, run.output()
        assert wrong not in run.output() and wrong not in str(run.readyz())

        write_private(token_file, good + "\n")
        run.wait_check("agent", "ok")
        run.wait_logged("agent accepts the token again")  # read from its output by a thread
        run.wait_logged("agent accepts the token again")  # its reader thread may lag
        assert run.count("agent accepts the token again") == 1, run.output()
        assert good not in run.output()
    finally:
        run.stop()
        agent.stop(signal.SIGKILL)


def test_the_agent_going_and_coming_back_is_one_line_each(short_dir: Path,
                                                          stand_in: StandIn) -> None:
    """Started with the agent's socket missing, the plugin logs "agent unreachable" once
    while its parts retry (and /readyz is asked again and again: the retries show at debug
    level only); the agent started logs "agent reachable again" once, the token is checked,
    and the check is ok; the agent killed is one more "agent unreachable"."""
    state = short_dir / "state"
    plugin_token = secrets.token_hex(16)
    lines = f"admin:{secrets.token_hex(16)}\nplugin:{plugin_token}:claims\n"
    token_file = write_private(short_dir / "plugin.token", plugin_token + "\n")
    socket = state / "agent.sock"
    run = start_plugin(short_dir, socket=socket, token_file=token_file, real_kubernetes=True,
                       kubeconfig=kubeconfig(short_dir / "kubeconfig", stand_in.url,
                                             stand_in.token),
                       extra=("--log-level", "debug"))
    agent: AgentProcess | None = None
    recovering = "reading the agent's claims for their status failed; retrying"
    try:
        found = run.wait_check("agent", reasons.AGENT_UNREACHABLE.text)
        assert str(socket) in found, found
        gone = run.wait_logged("agent unreachable")
        assert gone["socket"] == str(socket) and gone["level"] == "warning", gone
        rounds(run, "agent")
        wait_for(lambda: run.count(recovering) >= 3, "the claim status reader's retries")
        assert [line["level"] for line in run.logged(recovering)][:3] == [
            "info", "debug", "debug"], run.output()
        run.wait_logged("agent unreachable")  # its reader thread may lag
        assert run.count("agent unreachable") == 1, run.output()
        assert run.count("agent reachable again") == 0

        agent = agent_with_tokens(state, lines)
        run.wait_check("agent", "ok")
        run.wait_logged("agent reachable again")
        run.wait_logged("agent reachable again")  # its reader thread may lag
        assert run.count("agent reachable again") == 1, run.output()
        assert run.count("agent token refused") == 0

        agent.stop(signal.SIGKILL)
        run.wait_check("agent", reasons.AGENT_UNREACHABLE.text)
        rounds(run, "agent")
        assert run.count("agent unreachable") == 2, run.output()
        assert run.count("agent reachable again") == 1
    finally:
        run.stop()
        if agent is not None:
            agent.stop(signal.SIGKILL)
