"""Issue 13 against a real agent process: hostile bodies, headers, names and query strings get a
4xx problem naming what was wrong, never a 500, and every mutating request gets its audit
line; a second agent on the same CDI directory neither starts nor removes the first's specs."""

from __future__ import annotations

import http.client
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, Reply, start_agent
from tests.waiting import wait_for

# ``ops:...:`` lists no scope (all of them, as documented); ``reader`` holds read only.
OPS = "ops-token-Jk31pQ"
READER = "reader-token-Mx70aZ"
_IDS = itertools.count()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    root = tmp_path_factory.mktemp("hostile")
    tokens = root / "tokens"
    tokens.write_text(f"ops:{OPS}:\nreader:{READER}:read\n")
    tokens.chmod(0o600)
    process = start_agent(root / "state", extra=["--token-file", str(tokens),
                                                 "--metrics-listen", "127.0.0.1:0"])
    process.token = OPS
    yield process
    process.stop(signal.SIGKILL)


def send(agent: AgentProcess, method: str, path: str, *, body: bytes | None = None,
         headers: dict[str, str | bytes] | None = None, address: tuple[str, int] | None = None,
         timeout: float = 10) -> tuple[Reply, str]:
    """One request of exactly these bytes (headers may be raw bytes); the reply and the
    request id it was sent with."""
    request_id = f"hostile-{next(_IDS)}"
    conn = http.client.HTTPConnection(*(address or agent.address), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        sent = {"X-Request-Id": request_id, "Content-Type": "application/json",
                "Content-Length": str(len(body or b"")), **(headers or {})}
        for name, value in sent.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    out = {k.lower(): v for k, v in response.getheaders()}
    parsed: Any = payload.decode(errors="replace")
    if out.get("content-type", "").split(";")[0].endswith("json"):
        parsed = json.loads(payload)
    return Reply(response.status, out, parsed), request_id


def bearer(token: str = OPS) -> dict[str, str | bytes]:
    return {"Authorization": f"Bearer {token}"}


def metrics_address(agent: AgentProcess) -> tuple[str, int]:
    host, port = agent.listener("metrics").split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def audited(agent: AgentProcess, request_id: str, timeout: float = 5) -> str:
    """The audit line of the request sent with ``request_id`` ('' if none appears)."""
    def line() -> str:
        return next((line for line in agent.log().splitlines()
                     if "logger=agent.audit" in line and f"request_id={request_id}" in line), "")
    try:
        found: str = wait_for(line, f"the audit line of {request_id}", timeout, every_s=0.05)
    except AssertionError:
        return ""
    return found


def assert_problem(reply: Reply, status: int, *words: str) -> None:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.content_type == "application/problem+json", reply.headers
    text = json.dumps(reply.body)
    for word in words:
        assert word in text, (word, reply.body)


def nested(depth: int) -> bytes:
    return b'{"devices": ' + b"[" * depth + b"]" * depth + b"}"


# --- item 1: the YAML alias bomb ---------------------------------------------------------


def alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for n in range(1, levels):
        refs = ",".join([f"*a{n - 1}"] * 9)
        lines.append(f"a{n}: &a{n} [{refs}]")
    return "version: v1\nmig-configs:\n  x: []\n" + "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once_without_echo(agent: AgentProcess) -> None:
    """A config with anchors and aliases (here 9^6 strings from under 500 bytes) is a 422
    naming the aliases, answered at once in a small body, and /healthz stays responsive."""
    bomb = alias_bomb(6)
    assert len(bomb) < 600
    started = time.monotonic()
    reply, _ = send(agent, "POST", "/v1/mig/apply", headers=bearer(),
                    body=json.dumps({"config": bomb, "label": "x"}).encode())
    elapsed = time.monotonic() - started
    assert_problem(reply, 422, "aliases", "config")
    assert len(json.dumps(reply.body)) < 4096
    assert "lol" not in json.dumps(reply.body)
    assert elapsed < 2, elapsed
    assert agent.request("GET", "/healthz", token=None).status == 200


@pytest.mark.parametrize(("config", "words"), [
    ("version: v1\nmig-configs: &m {x: [{devices: all, mig-enabled: false}]}\n", "anchors"),
    ("version: v1\n" + "mig-configs:\n  x:\n" + "    - " + "[" * 40 + "]" * 40 + "\n",
     "deep"),
    ("version: v1\n# " + "x" * 70_000 + "\nmig-configs: {}\n", "characters"),
])
def test_yaml_configs_are_bounded(agent: AgentProcess, config: str, words: str) -> None:
    """An anchor, nesting past the bound, or text past the size bound is a 422 naming why."""
    reply, _ = send(agent, "POST", "/v1/mig/apply", headers=bearer(),
                    body=json.dumps({"config": config, "label": "x"}).encode())
    assert_problem(reply, 422, words)
    assert len(json.dumps(reply.body)) < 4096


# --- item 2: deep JSON and the audit line ------------------------------------------------


@pytest.mark.parametrize(("method", "path", "token", "status"), [
    ("DELETE", "/v1/claims/deep-0", OPS, 204),     # the body is not read: the unprepare runs
    ("PUT", "/v1/claims/deep-1", OPS, 400),
    ("PUT", "/v1/claims/deep-2", None, 401),
    ("POST", "/v1/topology/select", None, 400),
])
def test_a_600_deep_body_is_answered_and_audited(agent: AgentProcess, method: str, path: str,
                                                 token: str | None, status: int) -> None:
    """A body nested 600 deep is never a 500: a 400 naming the depth where the body is read,
    and an audit line for every mutating request, with or without a token."""
    reply, request_id = send(agent, method, path, body=nested(600),
                             headers=bearer(token) if token else {})
    assert reply.status == status, reply.body
    if status >= 400:
        assert reply.content_type == "application/problem+json"
    if status == 400:
        assert "400 deep" in reply.body["detail"]
    line = audited(agent, request_id)
    if method != "POST":  # /v1/topology/select is a query, logged as access
        assert line and f"status={status}" in line, agent.log()[-2000:]


def test_nesting_up_to_the_bound_is_read(agent: AgentProcess) -> None:
    """400 deep is still parsed (and refused by the model: devices must be objects)."""
    reply, _ = send(agent, "PUT", "/v1/claims/deep-ok", body=nested(399), headers=bearer())
    assert_problem(reply, 422, "devices")


# --- item 3: the other 500s -------------------------------------------------------------


def test_a_claim_uid_ending_in_a_newline_is_a_422(agent: AgentProcess) -> None:
    """``a%0A`` is not a claim UID (``$`` let it through to the CDI name check)."""
    body = json.dumps({"devices": [{"kind": "gpu", "device": "gpu-0"}]}).encode()
    for path in ("/v1/claims/a%0A", "/v1/claims/a%0A%0A", "/v1/claims/%0A"):
        for method in ("PUT", "DELETE", "GET"):
            reply, _ = send(agent, method, path, body=body, headers=bearer())
            assert_problem(reply, 422, "uid")


@pytest.mark.parametrize("number", [b"9" * 5000, b"-" + b"9" * 5000, b"1e99999", b"NaN",
                                    b"Infinity", b"1" + b"0" * 25])
def test_a_huge_number_in_a_body_is_a_400(agent: AgentProcess, number: bytes) -> None:
    """A number no field can take (5000 digits, out of range, not JSON) is a 400 naming it."""
    body = b'{"count": ' + number + b"}"
    reply, _ = send(agent, "POST", "/v1/topology/select", body=body)
    assert_problem(reply, 400, "body")


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer " + OPS.encode()
                                   + b"\x80", b"B\xe9arer x"])
def test_a_non_utf8_authorization_header_is_a_401(agent: AgentProcess, value: bytes) -> None:
    """Undecodable bytes in Authorization are a 401 problem (and the refusal is audited)."""
    reply, request_id = send(agent, "DELETE", "/v1/claims/enc", headers={"Authorization": value})
    assert_problem(reply, 401, "token")
    assert audited(agent, request_id)


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/", 404), ("GET", "/v1/gpus", 404), ("GET", "/.env", 404),
    ("POST", "/metrics", 405), ("DELETE", "/healthz", 405), ("PUT", "/readyz", 405),
    ("GET", "/healthz?verbose=1", 400),
])
def test_the_metrics_listener_answers_scanners_with_problems(agent: AgentProcess, method: str,
                                                             path: str, status: int) -> None:
    """Every unknown path or method on --metrics-listen is a 404/405 problem, not a 500."""
    reply, _ = send(agent, method, path, address=metrics_address(agent))
    assert_problem(reply, status)


# --- item 4: unknown query parameters ----------------------------------------------------


def test_a_query_parameter_typo_changes_nothing(agent: AgentProcess) -> None:
    """``?dryrun=true`` (for dry_run) is a 400 naming it, and the GPU keeps its geometry."""
    before = agent.request("GET", "/v1/gpus/1/mig").body["instances"]
    body = json.dumps({"profiles": ["3g.40gb", "3g.40gb"]}).encode()
    reply, request_id = send(agent, "PUT", "/v1/gpus/1/mig?dryrun=true", body=body,
                             headers=bearer())
    assert_problem(reply, 400, "dryrun", "dry_run")
    assert agent.request("GET", "/v1/gpus/1/mig").body["instances"] == before
    assert agent.request("GET", "/v1/transitions").body["transitions"] == []
    assert "dryrun=true" in audited(agent, request_id)
    twice, _ = send(agent, "PUT", "/v1/gpus/1/mig?dry_run=true&dry_run=false", body=body,
                    headers=bearer())
    assert_problem(twice, 400, "dry_run", "more than once")


def test_every_route_refuses_an_unknown_query_parameter(agent: AgentProcess) -> None:
    """Each route of /openapi.json (with the token, so auth passes) answers ``?bogus=1``
    with a 400 naming ``bogus``, before its handler runs."""
    doc = agent.request("GET", "/openapi.json").body
    samples = {"gpu": "0", "uid": "q-claim", "id": "nope", "apply_id": "nope", "pid": "1",
               "domain": "q-domain"}
    checked = 0
    for path, methods in doc["paths"].items():
        if path.startswith("/v1/sim/"):
            continue
        concrete = path
        for name, value in samples.items():
            concrete = concrete.replace("{" + name + "}", value)
        for method in methods:
            reply, _ = send(agent, method.upper(), concrete + "?bogus=1", body=b"{}",
                            headers=bearer())
            assert_problem(reply, 400, "bogus")
            checked += 1
    assert checked > 20


# --- item 8: lax coercion ------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("PUT", "/v1/gpus/2/mig?dry_run=true",
     {"mig_enabled": True, "drain": {"timeout_s": "60"}}, "drain.timeout_s"),
    ("PUT", "/v1/gpus/2/mig?dry_run=true", {"mig_enabled": "false"}, "mig_enabled"),
    ("POST", "/v1/topology/select", {"count": True}, "count"),
    ("POST", "/v1/topology/select", {"count": 2.0}, "count"),
    ("PUT", "/v1/gpus/2/mig?dry_run=true",
     {"instances": [{"profile": "3g.40gb", "placement": {"start": "0", "size": 4}}]},
     "instances[0].placement.start"),
    ("PUT", "/v1/claims/strict", {"devices": [{"kind": "gpu", "device": 3}]},
     "devices[0].device"),
])
def test_strict_types_are_not_coerced(agent: AgentProcess, method: str, path: str,
                                      body: dict[str, Any], field: str) -> None:
    """A value of the wrong JSON type is a 422 naming the field, never coerced."""
    reply, _ = send(agent, method, path, body=json.dumps(body).encode(), headers=bearer())
    assert_problem(reply, 422)
    assert field in [e["field"] for e in reply.body["errors"]], reply.body


@pytest.mark.parametrize("raw", [
    b'{"count": 1, "count": 2}',
    b'{"count": 1, "candidates": [0], "candidates": [1]}',
])
def test_duplicate_keys_are_refused(agent: AgentProcess, raw: bytes) -> None:
    """A key twice in one JSON object is a 400 naming the key (not last-one-wins)."""
    reply, _ = send(agent, "POST", "/v1/topology/select", body=raw)
    assert_problem(reply, 400, "twice")


@pytest.mark.parametrize("device", ["gpu-\u0662", "gpu-02", "gpu-2\n", "gpu-2 ", "\u0662"])
def test_one_spelling_per_device_name(agent: AgentProcess, device: str) -> None:
    """Only ``gpu-2`` (or index ``2``) names GPU 2: Arabic digits, a leading zero or a
    trailing newline are a 422 and prepare nothing."""
    uid = f"spelling-{abs(hash(device)) % 10_000}"
    body = json.dumps({"devices": [{"kind": "gpu", "device": device}]}).encode()
    reply, _ = send(agent, "PUT", f"/v1/claims/{uid}", body=body, headers=bearer())
    assert_problem(reply, 422, "device")
    assert agent.request("GET", f"/v1/claims/{uid}").status == 404


@pytest.mark.parametrize("ref", ["%D9%A2", "02", "2%0A", "%EF%BC%92", "+2", "2.0"])
def test_one_spelling_per_gpu_reference(agent: AgentProcess, ref: str) -> None:
    """A GPU reference in a path is an ASCII index without leading zeros, or a UUID."""
    reply, _ = send(agent, "GET", f"/v1/gpus/{ref}")
    assert_problem(reply, 404, "no GPU")


def test_an_empty_scope_list_means_every_scope(agent: AgentProcess) -> None:
    """A token line ``name:tok:`` grants all scopes, as the docs say of listing none."""
    body = json.dumps({"mig_enabled": True}).encode()
    reply, _ = send(agent, "PUT", "/v1/gpus/3/mig?dry_run=true", body=body, headers=bearer())
    assert reply.status == 200, reply.body
    reader, _ = send(agent, "PUT", "/v1/gpus/3/mig?dry_run=true", body=body,
                     headers=bearer(READER))
    assert_problem(reader, 403, "geometry")


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(agent: AgentProcess, scheme: str) -> None:
    """RFC 9110 makes the auth scheme case-insensitive."""
    reply, _ = send(agent, "DELETE", "/v1/claims/scheme", headers={
        "Authorization": f"{scheme} {OPS}"})
    assert reply.status == 204, reply.body


# --- item 7: a shared CDI directory -------------------------------------------------------


def _prepare(agent: AgentProcess, uid: str, device: str) -> Reply:
    return agent.request("PUT", f"/v1/claims/{uid}",
                         {"devices": [{"kind": "gpu", "device": device}]})


def test_a_second_agent_on_one_cdi_dir_is_refused_and_removes_nothing(tmp_path: Path) -> None:
    """While agent A runs, agent B (own state dir, same --cdi-dir) exits at start naming the
    directory; after A stops, B starts and leaves A's claim spec alone."""
    cdi = tmp_path / "cdi"
    first = start_agent(tmp_path / "a", extra=["--cdi-dir", str(cdi)])
    try:
        assert _prepare(first, "claim-of-a", "gpu-0").status == 200
        spec = cdi / "k8s.gpu.nodeagent.dev-claim_claim-of-a.json"
        assert spec.exists()
        second = subprocess.run(
            [sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100", "--state-dir",
             str(tmp_path / "b"), "--cdi-dir", str(cdi), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode != 0
        assert f"--cdi-dir {cdi} is in use by another running gpu-agent" in \
            second.stdout + second.stderr, second.stdout + second.stderr
        assert spec.exists()
    finally:
        first.stop()
    later = start_agent(tmp_path / "b", extra=["--cdi-dir", str(cdi)])
    try:
        assert spec.exists(), "agent B removed agent A's claim spec"
        assert _prepare(later, "claim-of-b", "gpu-1").status == 200
        listed = later.request("GET", "/v1/cdi").body["specs"]
        assert str(spec) not in [s["path"] for s in listed]
        assert later.request("DELETE", "/v1/claims/claim-of-a").status == 204
        assert spec.exists()
    finally:
        later.stop()
    again = start_agent(tmp_path / "a", extra=["--cdi-dir", str(cdi)])
    try:
        # A finds its claim and spec as it left them; B's spec is not A's to remove.
        assert again.request("GET", "/v1/claims/claim-of-a").status == 200
        assert spec.exists()
        assert (cdi / "k8s.gpu.nodeagent.dev-claim_claim-of-b.json").exists()
        assert again.request("DELETE", "/v1/claims/claim-of-a").status == 204
        assert not spec.exists()
    finally:
        again.stop()


@pytest.mark.parametrize("wire", [
    b"PUT /v1/claims/x HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"PUT /v1/claims/x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /v1/node HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /v1/node HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n",
    b"GET /v1/gpus/\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/node?since=\xc2\xb2 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n",
])
def test_requests_the_http_parser_refuses_get_a_problem(agent: AgentProcess,
                                                        wire: bytes) -> None:
    """A request line or header aiohttp cannot parse is a 400 problem too, naming why."""
    for address in (agent.address, metrics_address(agent)):
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(wire)
            response = http.client.HTTPResponse(sock)
            response.begin()
            payload = response.read()
        assert response.status == 400, payload
        assert response.getheader("Content-Type", "").startswith("application/problem+json")
        assert json.loads(payload)["detail"]
