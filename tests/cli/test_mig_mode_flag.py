"""The Ampere 409 in each client's words (issue 24): the API's problem is typed
(``mig-mode-needs-explicit``) and carries ``mig_enabled``; ``gpu-agent mig set`` tells its user
the flag to add, not the JSON field to send."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.agent_process import AgentProcess, start_agent


@pytest.fixture(scope="module")
def a100(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """A simulated DGX A100 (Ampere: MIG mode changes only with a reset), MIG off."""
    agent = start_agent(tmp_path_factory.mktemp("a100") / "state", preset="dgx-a100")
    yield agent
    agent.stop(signal.SIGKILL)


def _mig_set(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "mig", "set", *args, "--url",
                           agent.url, "--token-file", str(agent.state_dir / "tokens")],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_api_problem_is_typed_and_names_the_value(a100: AgentProcess) -> None:
    refused = a100.request("PUT", "/v1/gpus/0/mig", {"profiles": ["3g.20gb"]})
    assert refused.status == 409
    assert refused.body["type"].endswith("/mig-mode-needs-explicit")
    assert refused.body["mig_enabled"] is True
    assert '"mig_enabled": true' in refused.body["detail"]  # an API user's words stay


def test_mig_set_says_to_add_enable(a100: AgentProcess) -> None:
    done = _mig_set(a100, "0", "3g.20gb")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert "add --enable to 'gpu-agent mig set'" in done.stderr
    assert "mig_enabled" not in done.stderr and "Traceback" not in done.stderr
    asked = _mig_set(a100, "0", "3g.20gb", "--enable", "--dry-run")
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.startswith("plan (dry run): enable MIG")
