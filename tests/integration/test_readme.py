"""The README's tour is executed: every ``sh`` block, in order, on a fresh simulated agent as
``make run`` starts it, with curl failing on any HTTP error, leaving the node as it found it so
the cookbook runs after it; and its flag table is the parser's."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from agent.cli.main import serve_flag_table
from tests.agent_process import start_agent
from tests.docs.scripts import (
    README,
    cookbook,
    cookbook_setup,
    failure,
    node_state,
    readme_tour,
    run_script,
    shell_env,
)
from tests.tools import require_tool

_TABLE = re.compile(r"<!-- generated from the parser[^\n]*-->\n(.*?)\n<!-- end of generated "
                    r"table -->", re.S)


def test_readme_tour_runs_on_a_fresh_agent_cleans_up_and_the_cookbook_runs_after_it(
        tmp_path: Path) -> None:
    """Every tour command exits 0 and no request answers an error, in order, on a fresh
    agent; each geometry change but the one the tour's fault breaks succeeds; afterwards the
    node is as the tour found it (no claim, process, fault, latency, MIG layout or mark left
    behind), so docs/cookbook.md then runs on the same agent, from its own setup lines."""
    require_tool("curl", "apt-get install curl")
    # As `make run` in this directory: state in ./.gpu-agent-sim, the CLI in .venv/bin.
    agent = start_agent(tmp_path / ".gpu-agent-sim")
    shim = tmp_path / ".venv" / "bin" / "gpu-agent"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent "$@"\n')
    shim.chmod(0o755)
    try:
        fresh = node_state(agent)
        port = agent.address[1]
        done = run_script(readme_tour(port), tmp_path, shell_env())
        assert done.returncode == 0, failure(done, "a tour command")
        transitions = agent.request("GET", "/v1/transitions").body["transitions"]
        states = {(t["gpu_index"], t["state"]) for t in transitions}
        assert states >= {(0, "succeeded"), (1, "succeeded")}, transitions
        assert {t["state"] for t in transitions if t["gpu_index"] != 5} == {"succeeded"}
        assert node_state(agent) == fresh, "the tour left the node changed"
        done = run_script(cookbook_setup(port) + cookbook(), tmp_path, shell_env())
        assert done.returncode == 0, failure(done, "a cookbook command, after the tour,")
        assert agent.token and agent.token not in done.stdout
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
