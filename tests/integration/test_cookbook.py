"""docs/cookbook.md is executed: every ``sh`` block, in order, against a simulated agent, and
every route the agent serves must appear in it."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from agent.api.app import all_routes
from tests.agent_process import start_agent
from tests.docs.scripts import COOKBOOK, cookbook, failure, run_script, sh_blocks, shell_env
from tests.tools import require_tool


def _blocks() -> list[str]:
    return sh_blocks(COOKBOOK)


def _commands() -> list[str]:
    """Commands with their continuation lines joined."""
    text = "\n".join(_blocks()).replace("\\\n", " ")
    commands: list[str] = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending} {line}" if pending else line
        if pending.count("'") % 2 == 0:  # a quoted JSON body may span lines
            commands.append(pending)
            pending = ""
    return [c for c in commands if "curl" in c]


def test_every_route_is_in_the_cookbook() -> None:
    commands = _commands()
    missing = []
    for route in all_routes(simulated=True):
        path = re.escape(route.path)
        path = re.sub(r"\\\{[a-z_]+\\\}", r"[^/?\"' ]+", path)
        url = re.compile(r'\$API' + path + r'(?:[?"\' ]|$)')
        method = "" if route.method == "GET" else f"-X {route.method}"
        if not any(url.search(c) and (method in c if method else "-X " not in c)
                   for c in commands):
            missing.append(f"{route.method} {route.path}")
    assert not missing, f"routes without a cookbook example: {missing}"


def test_cookbook_runs_against_a_simulated_agent(tmp_path: Path) -> None:
    require_tool("curl", "apt-get install curl")
    agent = start_agent(tmp_path / "state")
    try:
        done = run_script(cookbook(), tmp_path,
                          shell_env(API=agent.url, TOKEN=agent.token or ""), timeout=60)
        assert done.returncode == 0, failure(done, "a cookbook command")
        assert agent.token and agent.token not in done.stdout
    finally:
        agent.stop(signal.SIGKILL)
