"""Hostile fuzzing (issue 13), bounded for CI: a few hundred raw requests with deep, huge,
duplicated, mistyped and misencoded bodies, odd paths, query strings and headers against a
real agent process. No 5xx, every 4xx the application answers is a problem, and no request
that could mutate goes without its audit line. ``HOSTILE_FUZZ_REQUESTS`` raises the bound;
``python -m tests.reliability.hostile_fuzz --seconds N`` is the long run."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.reliability.hostile_fuzz import run

REQUESTS = int(os.environ.get("HOSTILE_FUZZ_REQUESTS", "400"))


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path_factory.mktemp("hostile-fuzz") / "state")
    yield agent
    agent.stop(signal.SIGKILL)


@pytest.mark.parametrize("seed", [13, 1013])
def test_hostile_requests_get_no_500_and_every_mutation_its_audit_line(
        target: AgentProcess, seed: int) -> None:
    """Every hostile request is answered below 500, 4xx answers are problems, and each
    request that could mutate has an agent.audit line."""
    outcome = run(target, requests=REQUESTS // 2, seed=seed)
    print(outcome.summary())
    assert outcome.requests == REQUESTS // 2
    assert outcome.reached_app > outcome.requests // 2, outcome.summary()
    assert outcome.mutating > 50, outcome.summary()
    assert not outcome.server_errors, outcome.server_errors[:5]
    assert not outcome.not_problems, outcome.not_problems[:5]
    assert not outcome.unaudited, outcome.unaudited[:5]
    assert target.request("GET", "/healthz", token=None).status == 200
