"""Access control end to end against a real agent process: tokens, scopes, TLS with client
certificates, the Unix socket's mode, token reloads and audit lines without secrets."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.integration.test_cli import cli
from tests.tools import require_tool
from tests.waiting import wait_for

OPS = "ops-secret-Zq81mXv0aa"
READER = "reader-secret-Hh27pLkk"
NEW = "rotated-secret-Wc55yTrr"


def _token_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    root = tmp_path_factory.mktemp("access")
    tokens = _token_file(root / "tokens", f"ops:{OPS}:admin\nreader:{READER}:read\n")
    agent = start_agent(root / "state", extra=["--token-file", str(tokens),
                                               "--socket-group", "0"])
    agent.token = OPS
    yield agent
    agent.stop(signal.SIGKILL)


def test_tokens_decide_who_may_mutate(guarded: AgentProcess) -> None:
    assert guarded.request("DELETE", "/v1/sim/faults", token=None).status == 401
    assert guarded.request("DELETE", "/v1/sim/faults", token="not-a-token").status == 401
    denied = guarded.request("DELETE", "/v1/sim/faults", token=READER)
    assert denied.status == 403 and "admin" in denied.body["detail"]
    assert guarded.request("DELETE", "/v1/sim/faults", token=OPS).status == 204
    # Reads stay open without --auth-read.
    assert guarded.request("GET", "/v1/node", token=None).status == 200


def test_socket_is_0660_with_the_configured_group(guarded: AgentProcess) -> None:
    info = os.stat(guarded.socket_path)
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert info.st_gid == 0


def test_audit_lines_name_the_caller_and_carry_no_secret(guarded: AgentProcess) -> None:
    guarded.request("POST", "/v1/sim/faults", {"function": "nvmlDeviceGetCount",
                                               "error": "NVML_ERROR_UNKNOWN", "skip": 1000},
                    token=OPS)
    # A body that carries a secret by mistake is summarised without it.
    guarded.request("POST", "/v1/sim/xid", {"gpu": "x", "xid": 79, "token": OPS}, token=OPS)
    guarded.request("DELETE", "/v1/sim/faults", unix=True, token=OPS)
    guarded.request("DELETE", "/v1/sim/faults", token="not-a-token")

    # The refused request went last: once its line is there, so are the others'.
    wait_for(lambda: any("logger=agent.audit" in line and "status=401" in line
                         for line in guarded.log().splitlines()), "the refusal's audit line")
    log = guarded.log()
    audits = [line for line in log.splitlines() if "logger=agent.audit" in line]
    assert any("who=ops" in a and "method=POST" in a and "status=201" in a
               and "nvmlDeviceGetCount" in a for a in audits), audits
    assert any("pid=" in a and "uid=" in a and "path=/v1/sim/faults" in a for a in audits)
    assert any("status=401" in a and "result=refused" in a for a in audits)
    assert any("/v1/sim/xid" in a and "<redacted>" in a for a in audits)
    for secret in (OPS, READER, "not-a-token"):
        assert secret not in log


def test_reload_on_sighup_and_on_file_change(tmp_path: Path) -> None:
    tokens = _token_file(tmp_path / "tokens", f"ops:{OPS}\n")
    agent = start_agent(tmp_path / "state", extra=["--token-file", str(tokens)])
    try:
        assert agent.request("DELETE", "/v1/sim/faults", token=OPS).status == 204
        _token_file(tokens, f"ops:{NEW}\n")
        agent.proc.send_signal(signal.SIGHUP)
        _until(lambda: agent.request("DELETE", "/v1/sim/faults", token=NEW).status == 204,
               "the new token to be taken")
        assert agent.request("DELETE", "/v1/sim/faults", token=OPS).status == 401
        # A bad file keeps the tokens in use and says why.
        _token_file(tokens, "no-colon-here\n")
        agent.proc.send_signal(signal.SIGHUP)
        _until(lambda: "token reload failed" in agent.log(), "the failed reload's log line")
        assert agent.request("DELETE", "/v1/sim/faults", token=NEW).status == 204
        # A changed file is picked up without a signal (polled).
        _token_file(tokens, f"ops:{OPS}\n")
        _until(lambda: agent.request("DELETE", "/v1/sim/faults", token=OPS).status == 204,
               "the changed file to be picked up", timeout=10)
        for secret in (OPS, NEW):
            assert secret not in agent.log()
    finally:
        agent.stop(signal.SIGKILL)


def test_world_readable_token_file_stops_the_start(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops:{OPS}\n")
    tokens.chmod(0o644)
    done = subprocess.run([sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100",
                           "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0",
                           "--token-file", str(tokens)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert "readable or writable by group or others" in done.stderr
    assert f"chmod 600 {tokens}" in done.stderr
    assert OPS not in done.stdout + done.stderr


def _until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    wait_for(check, what, timeout, every_s=0.1)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool("openssl", "apt-get install openssl; it makes the test CA")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)
    return d


def _tls_get(url: str, path: str, context: ssl.SSLContext) -> int:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_tls_requires_a_client_certificate(tmp_path: Path, pki: Path) -> None:
    agent = start_agent(tmp_path / "state", wait_ready=False, extra=[
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem")])
    try:
        assert agent.url.startswith("https://127.0.0.1:")
        listeners = json.loads((agent.state_dir / "listeners.json").read_text())
        assert any(u.startswith("unix:") for u in listeners["listeners"])
        anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            _tls_get(agent.url, "/healthz", anonymous)
        plain = socket.create_connection(("127.0.0.1", int(agent.url.rsplit(":", 1)[1])))
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        plain.settimeout(5)
        assert b"200 OK" not in plain.recv(1024)
        plain.close()
        known = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        known.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        assert _tls_get(agent.url, "/healthz", known) == 200
        # The CLI: the CA and a client certificate by flags, or by environment; without the
        # certificate, a one-line error.
        ok = cli("node", "--url", agent.url, "--cacert", str(pki / "ca.pem"), "--cert",
                 str(pki / "client.pem"), "--key", str(pki / "client.key"))
        assert ok.returncode == 0, ok.stderr
        assert "simulated:dgx-h100" in ok.stdout, ok.stdout  # the backend line
        env = {"GPU_AGENT_CACERT": str(pki / "ca.pem"), "GPU_AGENT_CERT": str(pki / "client.pem"),
               "GPU_AGENT_KEY": str(pki / "client.key")}
        assert cli("gpus", "--url", agent.url, env=env).returncode == 0
        refused = cli("node", "--url", agent.url, "--cacert", str(pki / "ca.pem"))
        assert refused.returncode == 3
        assert refused.stderr.startswith("gpu-agent: cannot reach the agent")
        missing = cli("node", "--url", agent.url, "--cacert", str(pki / "nope.pem"))
        assert missing.returncode == 4 and "cannot load the TLS files" in missing.stderr
        # The Unix socket is unaffected by TLS.
        assert agent.request("GET", "/healthz", unix=True, token=None).status == 200
    finally:
        agent.stop(signal.SIGKILL)
    assert "BEGIN" not in agent.log()


def test_tls_flags_must_come_together(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100",
                           "--state-dir", str(tmp_path / "state"), "--tls-cert", "x.pem"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--tls-cert and --tls-key must be given together" in done.stderr
