"""A hostile fuzzer for the agent's API (issue 13): nastier than the schemathesis profile of
``test_fuzz_api.py``. It sends raw bytes over fresh sockets, so nothing a client library
would refuse is off limits: bodies nested up to 1,000 deep, 5,000-digit and out-of-range
numbers, ``NaN``, duplicate keys, non-UTF-8 and UTF-16 bodies, YAML alias bombs, wrong JSON
types, unknown and repeated query parameters, percent-encoded and raw odd bytes in paths,
non-UTF-8 ``Authorization`` headers, odd schemes and content types, unknown methods.

What it holds: no response is a 5xx; every 4xx is a problem+json (those aiohttp's parser
refuses before the application sees them included); and every request that reached the
application (it echoes the request's ``X-Request-Id``) and could mutate (any method but
GET/HEAD/OPTIONS, on any path but the read-only query routes) has its ``agent.audit`` line
in the agent's log.

``python -m tests.reliability.hostile_fuzz --seconds 300`` runs it against a fresh simulated
agent for a long run and prints the figures (docs/reliability.md records one).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import re
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, start_agent
from tests.waiting import wait_for

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_ODD_METHODS = ("PATCH", "OPTIONS", "TRACE", "FOO", "HEAD", "PROPFIND")
_SEGMENTS = ["0", "7", "02", "%D9%A2", "%EF%BC%92", "2%0A", "a%0A", "%0A", "-1", "+2", "2.0",
             "9" * 40, "9" * 5000, "%00", "%FF%FE", "..%2F..%2Fetc", "..", "%2e%2e", "a" * 300,
             "GPU-00000000-0000-0000-0000-000000000000", "MIG-x", "gpu-0", "gpu-0-mig-1g10gb-19-0",
             "claim-1", "%20", "%C3%28", "x;y", "%C2%B2"]
_SANE = ["0", "1", "2", "3", "claim-1", "claim-2", "claim-3"]
_QUERY_VALUES = ["true", "false", "1", "0", "TRUE", "yes", "", "%FF", "9" * 5000, "-1", "\u00b2",
                 "%D9%A2", "02"]
_CONTENT_TYPES = ["application/json", "application/json", "application/json; charset=utf-16",
                  "text/plain", "application/x-yaml", "", "application/json\u00e9",
                  "multipart/form-data; boundary=x", "application/problem+json"]
_SCHEMES = ["Bearer", "bearer", "BEARER", "Basic", "Bearer  ", "", "Token"]


@dataclass
class Outcome:
    """What one run saw."""

    requests: int = 0
    reached_app: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    mutating: int = 0
    accepted_mutations: int = 0
    server_errors: list[str] = field(default_factory=list)
    not_problems: list[str] = field(default_factory=list)
    unaudited: list[str] = field(default_factory=list)
    transport_errors: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        top = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return (f"{self.requests} requests in {self.seconds:.1f} s ({self.reached_app} reached "
                f"the app), {self.mutating} could mutate ({self.accepted_mutations} accepted); "
                f"5xx: {len(self.server_errors)}; 4xx not problem+json: "
                f"{len(self.not_problems)}; mutations without an audit line: "
                f"{len(self.unaudited)}; connections cut: {self.transport_errors}; "
                f"statuses {top}")


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    mutating: bool
    query: tuple[str, ...]


def operations(doc: dict[str, Any]) -> list[Operation]:
    """Every operation of an OpenAPI document but the simulator's controls."""
    found = []
    for path, methods in doc["paths"].items():
        if path.startswith("/v1/sim/"):
            continue
        for method, op in methods.items():
            query = tuple(p["name"] for p in op.get("parameters", []) if p.get("in") == "query")
            found.append(Operation(method.upper(), path, op.get("security") == [{"bearer": []}],
                                   query))
    return found


# --- bodies --------------------------------------------------------------------------------


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([50, 199, 201, 399, 400, 401, 600, 1000, 5000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    inner = opener * depth + b"1" + closer * depth
    return b'{"devices": ' + inner + b"}" if rng.random() < 0.5 else inner


def _number(rng: random.Random) -> bytes:
    return rng.choice([b"9" * 5000, b"-" + b"9" * 5000, b"1e99999", b"-1e99999", b"NaN",
                       b"Infinity", b"-Infinity", b"1" + b"0" * 25, b"0.1e-99999", b"00", b"-0",
                       b"1.5", b"true", b'"60"', b'"false"', b"null", b"1E400"])


def _typed(rng: random.Random) -> bytes:
    """A body shaped like a real request with one field of the wrong type or size."""
    num = _number(rng).decode()
    bodies = [
        f'{{"count": {num}}}',
        f'{{"mig_enabled": {num}}}',
        f'{{"mig_enabled": true, "drain": {{"policy": "wait", "timeout_s": {num}}}}}',
        f'{{"profiles": ["3g.40gb", {num}]}}',
        f'{{"instances": [{{"profile": "1g.10gb", "placement": {{"start": {num}, "size": 1}}}}]}}',
        f'{{"devices": [{{"kind": "gpu", "device": {num}}}]}}',
        '{"devices": [{"kind": "gpu", "device": "gpu-\u0662"}]}',
        '{"devices": [{"kind": "gpu", "device": "gpu-2\\n"}]}',
        '{"devices": [{"kind": "gpu", "device": "gpu-02"}]}',
        '{"devices": [{"kind": "gpu", "device": "gpu-1"}], "devices": []}',
        '{"count": 1, "count": 2}',
        '{"config": {"version": "v1", "version": "v1"}, "label": "x"}',
        '{"restore": "../../etc/passwd"}',
        f'{{"label": "x", "config": {{"version": "v1", "mig-configs": {{"x": [{{"devices": '
        f'"all", "mig-enabled": {num}}}]}}}}}}',
        '{"devices": [{"kind": "gpu", "device": "' + "x" * 100_000 + '"}]}',
        '{"' + "k" * 50_000 + '": 1}',
        '{"a": "\\ud800"}',
        '{"devices": [' + ",".join(['{"kind": "gpu", "device": "gpu-0"}'] * 40) + "]}",
    ]
    return rng.choice(bodies).encode()


def _yaml(rng: random.Random) -> bytes:
    levels = rng.choice([3, 6, 9])
    lines = ['a0: &a0 ["l","l","l","l","l","l","l","l","l"]']
    lines += [f"a{n}: &a{n} [" + ",".join([f"*a{n - 1}"] * 9) + "]" for n in range(1, levels)]
    configs = [
        "\n".join(lines),
        "version: v1\nmig-configs: &x {a: [{devices: all, mig-enabled: false}]}\nb: *x",
        "version: v1\nmig-configs:\n  x:\n  - " + "[" * 100 + "]" * 100,
        "version: v1\n" + "# pad\n" * 20_000,
        "!!python/object/apply:os.system ['true']",
        "version: v1\nmig-configs: {x: [{devices: all, mig-enabled: false, mig-enabled: true}]}",
        "\t\x00\xff",
    ]
    return json.dumps({"config": rng.choice(configs), "label": "x"}).encode()


def _encoding(rng: random.Random) -> bytes:
    return rng.choice([b"\xff\xfe{\x00}\x00", '{"count": 1}'.encode("utf-16"),
                       b"\xef\xbb\xbf{}", b'{"count": "\xff"}', b"\xc3\x28", b"{\x00}",
                       b'{"count": 1', b"[" * 10, b"}" * 10, b"\x1f\x8b\x08\x00junk"])


def _valid(rng: random.Random) -> bytes:
    """A well-formed body of one of the routes (so some requests do mutate)."""
    gpu = rng.randrange(8)
    return json.dumps(rng.choice([
        {"devices": [{"kind": "gpu", "device": f"gpu-{gpu}"}]},
        {"devices": [{"kind": "slice", "profile": "1g.10gb"}]},
        {"profiles": ["3g.40gb", "3g.40gb"]}, {"mig_enabled": False}, {"mig_enabled": True},
        {"count": rng.randrange(1, 9)}, {"label": "all-disabled", "config": {
            "version": "v1", "mig-configs": {"all-disabled": [
                {"devices": "all", "mig-enabled": False}]}}},
    ])).encode()


BODIES: dict[str, Callable[[random.Random], bytes]] = {
    "valid": _valid, "valid ": _valid,
    "deep": _deep, "number": lambda r: b'{"count": ' + _number(r) + b"}", "typed": _typed,
    "yaml": _yaml, "encoding": _encoding, "empty": lambda r: b"",
}


# --- requests ------------------------------------------------------------------------------


def _path(rng: random.Random, op: Operation) -> str:
    return re.sub(r"\{[^}]+\}", lambda _: rng.choice(_SEGMENTS), op.template)


def _query(rng: random.Random, op: Operation) -> str:
    roll = rng.random()
    if roll < 0.35:
        return ""
    known = list(op.query) or ["dry_run"]
    pairs: list[tuple[str, str]] = []
    if roll < 0.55:
        pairs.append((rng.choice(known), rng.choice(_QUERY_VALUES)))
    elif roll < 0.7:
        name = rng.choice(known)
        pairs += [(name, "true"), (name, "false")]
    else:
        pairs.append((rng.choice(["dryrun", "dry-run", "DRY_RUN", "force", "x" * 200, "%FF",
                                  "since", "a%00b"]), "true"))
    return "?" + "&".join(f"{k}={v}" for k, v in pairs)


def _authorization(rng: random.Random, token: str) -> bytes | None:
    roll = rng.random()
    if roll < 0.15:
        return None
    if roll < 0.3:
        return rng.choice([b"Bearer \xff\xfe", b"Bearer " + token.encode() + b"\x80",
                           b"\xc3\x28 x", b"Bearer", b"Bearer " + b"A" * 8000])
    return f"{rng.choice(_SCHEMES)} {token if rng.random() < 0.8 else 'wrong'}".encode()


def build(rng: random.Random, ops: list[Operation], token: str,
          request_id: str) -> tuple[Operation | None, str, bytes, str]:
    """One request: the operation it aims at (None for an unknown one), its method, its
    bytes on the wire and the kind of body it carries."""
    if rng.random() < 0.1:
        op = None
        method = rng.choice(["GET", "POST", "PUT", "DELETE", *_ODD_METHODS])
        path = rng.choice(["/", "/v2/gpus", "/v1/gpus/0/mig/../../../metrics", "/%FF",
                           "/v1/claims/", "/v1//claims//x", "/" + "a" * 2000, "/.env",
                           "/v1/sim/faults"]) + rng.choice(["", "?dryrun=1"])
    else:
        op = rng.choice(ops)
        method = op.method if rng.random() < 0.9 else rng.choice(_ODD_METHODS)
        path = _path(rng, op) + _query(rng, op)
    kind = rng.choice(list(BODIES))
    valid = kind.startswith("valid")
    if valid and op is not None:
        method = op.method
        path = re.sub(r"\{[^}]+\}", lambda _: rng.choice(_SANE), op.template)
        path += rng.choice(["", "?dry_run=true"] if "dry_run" in op.query else [""])
    body = BODIES[kind](rng)
    headers: list[tuple[bytes, bytes]] = [
        (b"Host", b"fuzz"), (b"X-Request-Id", request_id.encode()),
        (b"Content-Type", b"application/json" if valid else rng.choice(_CONTENT_TYPES).encode()),
        (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]
    auth = f"Bearer {token}".encode() if valid and rng.random() < 0.8 else \
        _authorization(rng, token)
    if auth is not None:
        headers.append((b"Authorization", auth))
    if rng.random() < 0.1:
        headers.append(rng.choice([(b"X-Odd", b"\xff\xfe\x00"[:2]), (b"Accept", b"*/*" * 500),
                                   (b"Content-Encoding", b"gzip"), (b"Expect", b"100-continue"),
                                   (b"X-Request-Id", b"second")]))
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return op, method, head + b"\r\n" + body, kind.strip()


def exchange(address: tuple[str, int], wire: bytes, method: str,
             timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """Send ``wire`` on a fresh connection and read the response."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.sendall(wire)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        payload = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, payload
    finally:
        sock.close()


def _needs_audit(op: Operation | None, method: str) -> bool:
    if method in SAFE_METHODS:
        return False
    # The read-only POST queries (topology/select) are audited only when no route matched.
    return op is None or op.mutating or op.method != method


def run(agent: AgentProcess, *, requests: int | None = None, seconds: float | None = None,
        seed: int = 13) -> Outcome:
    """Fuzz ``agent`` for ``requests`` requests or ``seconds`` seconds; check every answer
    and, at the end, that every request that could mutate was audited."""
    rng = random.Random(seed)
    doc = agent.request("GET", "/openapi.json").body
    ops = operations(doc)
    outcome = Outcome()
    sent: list[tuple[str, Operation | None, str, bool, str]] = []
    started = time.monotonic()
    n = 0
    while (requests is None or n < requests) and \
            (seconds is None or time.monotonic() - started < seconds):
        request_id = f"fz{seed}-{n}"
        n += 1
        op, method, wire, kind = build(rng, ops, agent.token or "", request_id)
        outcome.requests += 1
        outcome.kinds[kind] += 1
        label = f"{request_id} {wire[:160]!r}"
        try:
            status, headers, payload = exchange(agent.address, wire, method)
        except (OSError, http.client.HTTPException):
            outcome.transport_errors += 1  # the agent cut a request it could not frame
            continue
        outcome.statuses[status] += 1
        if status >= 500:
            outcome.server_errors.append(f"{status} {label}: {payload[:300]!r}")
        if 400 <= status < 500 and method != "HEAD" and \
                headers.get("content-type", "").split(";")[0] != "application/problem+json":
            outcome.not_problems.append(f"{status} {label}")
        if headers.get("x-request-id") == request_id:
            outcome.reached_app += 1
            needs = _needs_audit(op, method)
            outcome.mutating += needs
            outcome.accepted_mutations += needs and status < 300
            sent.append((request_id, op, method, needs, label))
    outcome.seconds = time.monotonic() - started
    logged = _logged(agent, {request_id for request_id, _, _, needs, _ in sent if needs})
    for request_id, _, _, needs, label in sent:
        if needs and logged.get(request_id) != "agent.audit":
            outcome.unaudited.append(label)
    return outcome


def _logged(agent: AgentProcess, audited: set[str], timeout_s: float = 10.0) -> dict[str, str]:
    """request id → logger of its line (``agent.audit`` or ``agent.access``), once every id
    of ``audited`` has its audit line (a line is written after the answer), or at the
    timeout: what is missing then is reported by the caller."""
    pattern = re.compile(r"logger=(agent\.audit|agent\.access) .*request_id=(\S+)")

    def read() -> dict[str, str]:
        found: dict[str, str] = {}
        for line in agent.log().splitlines():
            if match := pattern.search(line):
                found.setdefault(match[2], match[1])
        return found
    with contextlib.suppress(AssertionError):
        wait_for(lambda: audited <= {r for r, logger in read().items() if logger == "agent.audit"},
                 "every mutating request's audit line", timeout_s, every_s=0.05)
    return read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostile-fuzz-") as tmp:
        agent = start_agent(Path(tmp) / "state", extra=["--metrics-listen", "127.0.0.1:0"])
        try:
            outcome = run(agent, seconds=args.seconds, seed=args.seed)
            alive = agent.request("GET", "/healthz", token=None).status == 200
        finally:
            agent.stop(signal.SIGKILL)
    print(outcome.summary())
    print(f"body kinds: {dict(outcome.kinds)}; agent alive at the end: {alive}")
    for line in (outcome.server_errors + outcome.not_problems + outcome.unaudited)[:20]:
        print("  ", line)
    return 0 if alive and not (outcome.server_errors or outcome.not_problems
                               or outcome.unaudited) else 1


if __name__ == "__main__":
    raise SystemExit(main())
