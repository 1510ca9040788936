"""The README's tour is executed: every ``sh`` block, in order, on a fresh simulated agent as
``make run`` starts it, with curl failing on any HTTP error; and its flag table is the
parser's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from agent.cli.main import serve_flag_table
from tests.agent_process import start_agent
from tests.tools import require_tool

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
# Lines that start another agent or the test suite: the tour's agent is already running.
_NOT_TOUR = re.compile(r"^\s*(make (run|test)|\S*gpu-agent serve)\b")
_TABLE = re.compile(r"<!-- generated from the parser[^\n]*-->\n(.*?)\n<!-- end of generated "
                    r"table -->", re.S)


def _tour(port: int) -> str:
    """The README's sh blocks as one script, against the test agent's port."""
    lines = [line for block in _BLOCK.findall(README.read_text())
             for line in block.splitlines() if not _NOT_TOUR.match(line)]
    return "\n".join(lines).replace("localhost:9401", f"127.0.0.1:{port}")


def test_readme_tour_runs_top_to_bottom_on_a_fresh_agent(tmp_path: Path) -> None:
    """Every tour command exits 0 and no request answers an error, in order, on a fresh
    agent; afterwards the node is as the tour says: every GPU healthy, no fault left, and
    each geometry change but the one the tour's fault breaks succeeded."""
    require_tool("curl", "apt-get install curl")
    # As `make run` in this directory: state in ./.gpu-agent-sim, the CLI in .venv/bin.
    agent = start_agent(tmp_path / ".gpu-agent-sim")
    shim = tmp_path / ".venv" / "bin" / "gpu-agent"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent "$@"\n')
    shim.chmod(0o755)
    try:
        script = ("set -euo pipefail\ntrap 'echo \"FAILED: $BASH_COMMAND\" >&2' ERR\n"
                  'curl() { command curl --fail-with-body "$@"; }\n'
                  + _tour(agent.address[1]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (f"a tour command failed (exit {done.returncode}):\n"
                                      f"{done.stderr[-3000:]}\n--- stdout ---\n"
                                      f"{done.stdout[-2000:]}")
        gpus = agent.request("GET", "/v1/gpus").body["gpus"]
        assert [g["index"] for g in gpus if not g["health"]["healthy"]] == []
        assert agent.request("GET", "/v1/sim").body["faults"] == []
        transitions = agent.request("GET", "/v1/transitions").body["transitions"]
        states = {(t["gpu_index"], t["state"]) for t in transitions}
        assert states >= {(0, "succeeded"), (1, "succeeded")}, transitions
        assert {t["state"] for t in transitions if t["gpu_index"] != 5} == {"succeeded"}
    finally:
        agent.stop(signal.SIGKILL)


def test_readme_flag_table_is_generated_from_the_parser() -> None:
    """The README's table of serve flags is exactly what the parser generates: every flag,
    its value and its help with the default."""
    found = _TABLE.search(README.read_text())
    assert found is not None, "README.md lost its generated-table markers"
    expected = serve_flag_table()
    assert found[1] == expected, ("README.md's flag table drifted from the parser; replace it "
                                  f"with:\n{expected}")
