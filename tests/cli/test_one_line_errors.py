"""Every client verb family fails in one line (issue 24), run as the installed entry point runs:
with the agent down, a malformed URL, a token the agent does not know and a token file it
cannot read, stderr is exactly one line that says what to do, no traceback, and the exit
status names the kind of failure (``gpu-agent --help`` lists them)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent

#: One verb of each client family (reads, so a refusal is about the connection only).
FAMILIES = [["node"], ["gpus"], ["mig", "show"], ["claims"], ["transitions"], ["cdi", "list"],
            ["topo"], ["admin", "checkpoint"], ["sim", "show"]]

#: Each kind of failure: the flags that cause it, the exit status, what the line must say.
KINDS = {
    "socket missing": (["--url", "unix:{tmp}/absent.sock"], 3, "cannot reach the agent at unix:"),
    "nothing listening": (["--url", "http://127.0.0.1:1"], 3, "is it running?"),
    "malformed URL": (["--url", "http://[::1"], 2, "malformed URL"),
    "wrong token": (["--url", "{agent}", "--token-file", "{tmp}/wrong"], 4,
                    "pass --token-file with one of the tokens"),
    "token file unreadable": (["--url", "{agent}", "--token-file", "{tmp}"], 4,
                              "cannot read token file"),
    "token not a header value": (["--url", "{agent}", "--token-file", "{tmp}/accented"], 4,
                                 "only printable ASCII"),
}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """An agent whose reads need a token (``--auth-read``), so a wrong one is refused."""
    agent = start_agent(tmp_path_factory.mktemp("guarded") / "state", extra=["--auth-read"])
    yield agent
    agent.stop(signal.SIGKILL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("verb", FAMILIES, ids=" ".join)
def test_each_failure_is_one_line_naming_what_to_do(guarded: AgentProcess, tmp_path: Path,
                                                    verb: list[str], kind: str) -> None:
    (tmp_path / "wrong").write_text("ops:not-the-token\n")
    (tmp_path / "accented").write_text("ops:tökén\n")
    flags, code, says = KINDS[kind]
    argv = [f.format(tmp=tmp_path, agent=guarded.url) for f in flags]
    done = subprocess.run([sys.executable, "-m", "agent", *verb, *argv], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu-agent: "), done.stderr
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr
    assert done.returncode == code, done.stderr
    assert done.stdout == ""


def test_ctrl_c_while_waiting_on_the_agent_is_no_traceback(tmp_path: Path) -> None:
    """An agent that takes the request and never answers, then Ctrl-C: exit 130 (as a shell
    reports SIGINT), nothing on stderr."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        port = silent.getsockname()[1]
        cli = subprocess.Popen([sys.executable, "-m", "agent", "gpus", "--url",
                                f"http://127.0.0.1:{port}"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = silent.accept()
            with conn:
                conn.settimeout(30)
                request = b""
                while b"\r\n\r\n" not in request:  # the whole request sent: it waits now
                    request += conn.recv(4096)
                cli.send_signal(signal.SIGINT)
                out, err = cli.communicate(timeout=30)
        finally:
            cli.kill()
    assert request.startswith(b"GET /v1/gpus ")
    assert (cli.returncode, out, err) == (130, "", "")
