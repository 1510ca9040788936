"""Live progress of ``gpu-agent mig set --wait`` and ``mig apply --wait`` through a real agent
process: on a terminal (a pty) one block redrawn in place with the step, what the drain waits
for and the elapsed time; piped, plain lines, one per change."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.agent_process import AgentProcess
from tests.integration.owner_steps import wait_transition
from tests.integration.test_mig import MUTATING, put_mig

WAITING = "GPU 0: draining: waiting for process {pid} on 7g.80gb@0:8"


def follow(cmd: list[str], *, terminal: bool, until: Callable[[str], bool],
           then: Callable[[], None], timeout: float = 240) -> tuple[int, str]:
    """Run ``cmd`` with its output on a pty (``terminal``) or a pipe; once ``until(output)``
    holds, call ``then``, and read to the end. Its exit status and output."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if terminal:
        fd, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                                env={**env, "TERM": "xterm"})
        os.close(child)
    else:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
    out, fired = b"", False
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert time.monotonic() < deadline, f"no end after {timeout}s: {out!r}"
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the pty's other side is closed
                    chunk = b""
                if not chunk:
                    break
                out += chunk
            if not fired and until(out.decode(errors="replace")):
                fired = True
                then()
        return proc.wait(timeout), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if terminal:
            os.close(fd)
        elif proc.stdout is not None:
            proc.stdout.close()


#: Polls the drain must last: the output shows the blocker once however many there are.
POLLS = 3


def _polls(agent: AgentProcess) -> float:
    """GET requests the agent has answered for a transition or an apply, from /metrics."""
    text = agent.request("GET", "/metrics", token=None).body
    return sum(float(value) for labels, value in re.findall(
        r'^gpu_agent_http_requests_total\{(.*)\} (\S+)$', text, re.MULTILINE)
        if 'method="GET"' in labels and ("transitions/" in labels or "mig/apply/" in labels))


def _polled_while(agent: AgentProcess, waiting: str) -> Callable[[str], bool]:
    """Holds once ``waiting`` shows and the command has polled :data:`POLLS` times since."""
    seen: list[float] = []

    def polled(out: str) -> bool:
        if waiting not in out:
            return False
        if not seen:
            seen.append(_polls(agent))
        return _polls(agent) >= seen[0] + POLLS
    return polled


def _redrawn_while(waiting: str) -> Callable[[str], bool]:
    """Holds once :data:`POLLS` redraws showed ``waiting``, each with its own elapsed time."""
    def redrawn(out: str) -> bool:
        waited = [d for d in out.split("\x1b[J")[1:] if waiting in d]
        ticks = {m for d in waited for m in re.findall(r"\[(\d+\.\d)s\]", d)}
        return len(waited) >= POLLS and len(ticks) >= POLLS
    return redrawn


def _busy_7g(agent: AgentProcess, pid: int) -> None:
    """GPU 0 as one 7g.80gb with process ``pid`` on it, and each mutation slowed down enough
    for ``--wait``'s polls to see every step."""
    agent.request("PUT", "/v1/sim/latency", {})
    reply = put_mig(agent, "0", {"profiles": ["7g.80gb"]})
    if reply.status == 202:
        assert wait_transition(agent, reply.headers["location"])["state"] == "succeeded"
    device = agent.request("GET", "/v1/gpus/0", token=None).body["mig_devices"][0]
    agent.request("POST", "/v1/sim/processes", {"device": device["uuid"], "pid": pid})
    agent.request("PUT", "/v1/sim/latency", dict.fromkeys(MUTATING, 0.5))


#: The drain's bound: the test releases the blocker once the command has polled a few times,
#: which on a loaded machine can take long; a drain that ends early costs nothing of it.
DRAIN_TIMEOUT_S = "180"


def _command(agent: AgentProcess, verb: str, tmp_path: Path) -> list[str]:
    client = ["--url", agent.url, "--token-file", str(agent.state_dir / "tokens")]
    if verb == "set":
        return [sys.executable, "-m", "agent", "mig", "set", "0", "1g.10gb", "--drain", "wait",
                "--timeout", DRAIN_TIMEOUT_S, "--wait", *client]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "mig-configs": {"one": [
        {"devices": [0], "mig-enabled": True, "mig-devices": {"1g.10gb": 1}}]}}))
    return [sys.executable, "-m", "agent", "mig", "apply", "-f", str(config), "-c", "one",
            "--drain", "wait", "--timeout", DRAIN_TIMEOUT_S, "--wait", *client]


PIDS = {("set", False): 5101, ("set", True): 5102, ("apply", False): 5103,
        ("apply", True): 5104}


@pytest.mark.parametrize("verb", ["set", "apply"])
def test_piped_progress_is_plain_lines_one_per_change(h100: AgentProcess, verb: str,
                                                      tmp_path: Path) -> None:
    """Piped, ``--wait`` prints a plain line each time the GPU's state or step changes, with
    the elapsed time: the drain's blocker once however many polls it lasts, each step, the
    end; no escape sequence."""
    pid = PIDS[(verb, False)]
    _busy_7g(h100, pid)
    waiting = WAITING.format(pid=pid)
    rc, out = follow(_command(h100, verb, tmp_path), terminal=False,
                     until=_polled_while(h100, waiting),
                     then=lambda: h100.request("DELETE", f"/v1/sim/processes/{pid}"))
    assert rc == 0, out
    assert "\x1b" not in out and "\r" not in out
    progress = [line for line in out.splitlines() if re.match(r"\[ *\d+\.\ds\] GPU 0: ", line)]
    texts = [line.split("] ", 1)[1] for line in progress]
    assert texts.count(waiting) == 1, out
    assert len(texts) == len(set(texts)), out  # a line only when something changed
    after = texts[texts.index(waiting) + 1:]
    assert any(t.startswith("GPU 0: applying: destroy_gi 7g.80gb@0:8") for t in after), out
    assert any(t.startswith("GPU 0: applying: create_gi 1g.10gb@") for t in after), out
    assert texts[-1] == "GPU 0: succeeded", out


@pytest.mark.parametrize("verb", ["set", "apply"])
def test_terminal_progress_redraws_one_block(h100: AgentProcess, verb: str,
                                             tmp_path: Path) -> None:
    """On a terminal, ``--wait`` redraws its block in place (cursor up, clear) at each poll:
    the drain's blocker and a ticking elapsed time while it waits, then the end."""
    pid = PIDS[(verb, True)]
    _busy_7g(h100, pid)
    waiting = WAITING.format(pid=pid)
    rc, out = follow(_command(h100, verb, tmp_path), terminal=True,
                     until=_redrawn_while(waiting),
                     then=lambda: h100.request("DELETE", f"/v1/sim/processes/{pid}"))
    assert rc == 0, out
    assert "\x1b[2F\x1b[J" in out, out  # back over the two lines drawn: title and GPU 0
    draws = out.split("\x1b[J")[1:]
    # The process was released only after POLLS redraws of the wait, each with its own
    # elapsed time (else the drain timed out, and the command failed above).
    assert "GPU 0: succeeded" in draws[-1], out
