"""The kubelet plugin as a real process for the start-up and credential tests (issue 24): its
JSON log lines collected as they come, its ``/readyz``, and a small stand-in API server whose
answers a test sets (401, 403, a missing Node, a Node of another UID)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.kubeplugin.conftest import NODE
from tests.kubeplugin.test_process import stop
from tests.waiting import wait_for

#: What the harness gives the plugin process for its own wait on the API server.
STARTED = "kubelet plugin started"


@dataclass
class PluginRun:
    """A running ``gpu-agent kubelet-plugin`` (``tests.kubeplugin.plugin_main``)."""

    proc: subprocess.Popen[str]
    raw: list[str] = field(default_factory=list)
    health: str = ""

    @property
    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in list(self.raw):
            try:
                out.append(json.loads(raw))
            except ValueError:
                out.append({"msg": raw.rstrip("\n")})
        return out

    def count(self, msg: str) -> int:
        """How many log lines say ``msg``."""
        return sum(1 for line in self.lines if line.get("msg") == msg)

    def logged(self, msg: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("msg") == msg]

    def output(self) -> str:
        return "".join(self.raw)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{self.health}/readyz", timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def check(self, name: str) -> str:
        """One check of ``/readyz`` now (``ok`` or its reason)."""
        return str(self.readyz()[1]["checks"][name])

    def wait_check(self, name: str, starts: str, timeout_s: float = 30) -> str:
        """The check's reason once it starts with ``starts``."""
        return wait_for(lambda: (text := self.check(name)).startswith(starts) and text,
                        f"/readyz checks.{name} to start with {starts!r}", timeout_s)

    def wait_logged(self, msg: str, timeout_s: float = 30) -> dict[str, Any]:
        return wait_for(lambda: next(iter(self.logged(msg)), None),
                        f"a log line {msg!r}", timeout_s)

    def stop(self) -> None:
        stop(self.proc)


def start_plugin(root: Path, *, socket: Path, token_file: Path, kubeconfig: Path | None = None,
                 real_kubernetes: bool = False, env: dict[str, str] | None = None,
                 node: str = NODE, extra: tuple[str, ...] = ()) -> PluginRun:
    """The plugin process, once it logged that it started (its health address known). With
    ``real_kubernetes`` it uses the real Kubernetes wiring from ``kubeconfig`` (the
    publisher left out), else in-memory fakes."""
    args = [sys.executable, "-m", "tests.kubeplugin.plugin_main", "kubelet-plugin",
            "--agent-socket", str(socket), "--token-file", str(token_file),
            "--node-name", node, "--registry-dir", str(root / "reg"),
            "--plugins-dir", str(root / "plug"), "--health-listen", "127.0.0.1:0",
            "--log-format", "json", *(["--kubeconfig", str(kubeconfig)] if kubeconfig else []),
            *extra]
    environment = {**os.environ, **(env or {})}
    if real_kubernetes:
        environment["PLUGIN_MAIN_CLAIMS"] = "kubeconfig"
    return follow(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=environment))


def _started(line: str) -> str | None:
    """The health address of a "started" log line, JSON or text (``health=HOST:PORT``)."""
    if line.startswith("{"):
        doc = json.loads(line)
        return str(doc["health"]) if doc.get("msg") == STARTED else None
    found = re.search(r"\bhealth=(\S+)", line) if f'msg="{STARTED}"' in line else None
    return found[1] if found else None


def follow(proc: subprocess.Popen[str]) -> PluginRun:
    """``proc`` (a plugin, stdout and stderr piped together) with its output collected as it
    comes, once it logged that it started; stopped if it exits first."""
    run = PluginRun(proc)
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: run.raw.extend(out), daemon=True).start()
    try:
        health = wait_for(lambda: next((h for line in list(run.raw)
                                        if (h := _started(line))), None) or proc.poll(),
                          "the plugin to start", 60)
        assert isinstance(health, str), f"the plugin exited {health}: {run.output()}"
    except BaseException:
        run.stop()
        raise
    run.health = f"http://{health}"
    return run


def kubeconfig(path: Path, url: str, token: str, *, ca: Path | None = None) -> Path:
    """A kubeconfig (mode 0600) for ``url`` with a bearer token (the user ``plugin``)."""
    cluster: dict[str, Any] = {"server": url}
    if ca is not None:
        cluster["certificate-authority"] = str(ca)
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "plugin",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "plugin", "user": {"token": token}}],
        "contexts": [{"name": "plugin", "context": {"cluster": "c", "user": "plugin"}}]}))
    path.chmod(0o600)
    return path


def node_bound_jwt(node: str, uid: str, *, namespace: str = "gpu-node-agent",
                   account: str = "gpu-node-agent") -> str:
    """A token shaped as ``kubectl create token --bound-object-kind=Node`` makes one (not
    signed: only the stand-in server reads it)."""
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")
    claims = {"aud": ["https://kubernetes.default.svc"], "exp": 4102444800,
              "iss": "https://kubernetes.default.svc",
              "kubernetes.io": {"namespace": namespace,
                                "node": {"name": node, "uid": uid},
                                "serviceaccount": {"name": account, "uid": "sa-uid"}},
              "sub": f"system:serviceaccount:{namespace}:{account}"}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


@dataclass
class StandIn:
    """A stand-in API server: ``/version``, and this node's Node as ``node`` says (a dict:
    the Node; an int: that status). A request whose bearer token is not ``token`` is 401."""

    token: str
    node: dict[str, Any] | int = field(default_factory=lambda: {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "uid-1"}})
    paths: list[str] = field(default_factory=list)
    url: str = ""


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def serve(stand_in: StandIn) -> Iterator[StandIn]:
    """Run ``stand_in`` on 127.0.0.1 until the generator is closed."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            stand_in.paths.append(self.path)
            if self.headers.get("Authorization") != f"Bearer {stand_in.token}":
                self._answer(401, _status(401, "Unauthorized", "Unauthorized"))
            elif self.path == "/version":
                self._answer(200, {"major": "1", "minor": "37", "gitVersion": "v1.37.0"})
            elif self.path == f"/api/v1/nodes/{NODE}":
                if isinstance(stand_in.node, dict):
                    self._answer(200, stand_in.node)
                elif stand_in.node == 403:
                    self._answer(403, _status(403, "Forbidden", f'nodes "{NODE}" is forbidden: '
                                              "User cannot get resource"))
                else:
                    self._answer(stand_in.node, _status(stand_in.node, "NotFound",
                                                        f'nodes "{NODE}" not found'))
            else:
                self._answer(404, _status(404, "NotFound", "not found"))

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    stand_in.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stand_in
    finally:
        server.shutdown()
        server.server_close()
