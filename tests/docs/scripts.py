"""The docs' shell blocks as scripts a test runs: the README tour, the cookbook, the sharing
page's agent-side steps; and what a node looks like to a newcomer, to say whether a script left
it as it found it.

A doc's ``sh`` blocks run in order in one bash, ``set -euo pipefail``, a trap naming the
command that failed (never ``set -x``: it would print the token). The README promises none of
its requests answers an error, so its ``curl`` is wrapped with ``--fail-with-body``; a line
that expects an error says so itself (``|| echo ...``). The cookbook's commands carry their own
``-f`` where an error would be a failure and leave it off where the text says an error is the
answer.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
COOKBOOK = ROOT / "docs" / "cookbook.md"
SHARING = ROOT / "docs" / "sharing.md"

_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
_TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```", re.S | re.M)
# Lines that start another agent or the test suite: the tour's agent is already running.
_NOT_TOUR = re.compile(r"^\s*(make (run|test)|\S*gpu-agent serve)\b")
#: Every script starts so: the first failing command ends it and is named on stderr.
PRELUDE = "set -euo pipefail\ntrap 'echo \"FAILED: $BASH_COMMAND\" >&2' ERR\n"
#: The README's promise: no request of the tour answers an error.
FAILING_CURL = 'curl() { command curl --fail-with-body "$@"; }\n'


def sh_blocks(doc: Path) -> list[str]:
    """The ``sh`` blocks of ``doc``, in order."""
    return _BLOCK.findall(doc.read_text())


def readme_tour(port: int) -> str:
    """The README's sh blocks as one script (without the lines that start an agent or the
    suite), against the agent on ``port`` instead of 9401, curl failing on any error."""
    lines = [line for block in sh_blocks(README) for line in block.splitlines()
             if not _NOT_TOUR.match(line)]
    return PRELUDE + FAILING_CURL + "\n".join(lines).replace("localhost:9401",
                                                             f"127.0.0.1:{port}")


def cookbook_setup(port: int) -> str:
    """The ``export`` lines the cookbook gives for a simulated agent (``make run``), against
    the agent on ``port`` instead of 9401."""
    first = _TEXT_BLOCK.findall(COOKBOOK.read_text())[0]
    lines = [line for line in first.splitlines() if line.startswith("export ")]
    assert {line.split("=", 1)[0] for line in lines} == {"export API", "export TOKEN"}, lines
    return "\n".join(lines).replace("127.0.0.1:9401", f"127.0.0.1:{port}") + "\n"


def cookbook() -> str:
    """The cookbook's sh blocks as one script; ``API`` and ``TOKEN`` come from outside."""
    return PRELUDE + "\n".join(sh_blocks(COOKBOOK))


#: The agent's socket on a node, where docs/sharing.md's requests go.
NODE_SOCKET = "/run/gpu-agent/agent.sock"


def sharing_requests(socket: str) -> str:
    """The ``sh`` blocks of docs/sharing.md that call the agent (on a node's socket) as one
    script against ``socket``, curl failing on any error; ``TOKEN`` comes from outside."""
    blocks = [b for b in sh_blocks(SHARING) if f"--unix-socket {NODE_SOCKET}" in b]
    assert blocks, f"docs/sharing.md has no request to {NODE_SOCKET}"
    return PRELUDE + FAILING_CURL + "\n".join(blocks).replace(NODE_SOCKET, socket)


def shell_env(**extra: str) -> dict[str, str]:
    """The environment a newcomer's shell has: no ``GPU_AGENT_*`` settings of the test run,
    this interpreter's ``python3`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return {**env, **extra}


def run_script(script: str, cwd: Path, env: dict[str, str],
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``script`` in bash in ``cwd``; the finished process, whatever its exit."""
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def failure(done: subprocess.CompletedProcess[str], what: str) -> str:
    """A failed script's message: the command that failed and the ends of its output."""
    return (f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}\n--- stdout ---\n"
            f"{done.stdout[-2000:]}")


def node_state(agent: AgentProcess) -> dict[str, Any]:
    """What a newcomer's next command depends on: each GPU's MIG mode and devices, health,
    marks and holders; the claims and their CDI specs; the simulator's processes, MPS
    daemons, faults, latencies and per-GPU settings. Histories (events, transitions) are
    left out: they only grow."""
    gpus = agent.request("GET", "/v1/gpus").body["gpus"]
    sim = agent.request("GET", "/v1/sim").body
    claims = agent.request("GET", "/v1/claims").body["claims"]
    specs = agent.request("GET", "/v1/cdi").body
    return {
        "gpus": [{"index": g["index"], "mig_mode": g["mig_mode"],
                  "mig_devices": [(d["profile"], d["placement"]) for d in g["mig_devices"]],
                  "health": g["health"], "taints": g["taints"], "drained": g["drained"],
                  "availability": g["availability"]["state"], "holds": g["holds"],
                  "shares": g["shares"]} for g in gpus],
        "claims": [c["uid"] for c in claims],
        "cdi": sorted((Path(s["path"]).name, *s["devices"]) for s in specs["specs"]),
        "sim": {"processes": sim["processes"], "mps_daemons": sim["mps_daemons"],
                "faults": sim["faults"], "latencies": sim["latencies"],
                "gpus": [{k: v for k, v in g.items() if k not in ("uuid", "bus_id")}
                         for g in sim["gpus"]]},
    }
