"""API fuzzing (issue 8, item 4): schemathesis against the agent's own ``/openapi.json`` on a
real agent process (simulated DGX H100), with and without the token; the simulator's
``/v1/sim/*`` controls are excluded. Every response: no 5xx, conforms to the schema, and
every 4xx is ``application/problem+json``. ``FUZZ_EXAMPLES`` raises the bound for long runs."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi import checks

from tests.agent_process import AgentProcess, start_agent

# What issue 8 asks of every response. Not ``positive_data_acceptance``: cross-field rules
# (e.g. a MIG PUT needs one of profiles/instances/mig_enabled) are not expressible in the
# schema the models generate, and such bodies get a 422 problem, which is checked below.
CHECKS = [checks.content_type_conformance, checks.response_schema_conformance,
          checks.status_code_conformance, checks.response_headers_conformance]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    agent = start_agent(tmp_path_factory.mktemp("fuzz") / "state")
    yield agent
    agent.stop(signal.SIGKILL)


def test_api_conforms(fuzz_agent: AgentProcess) -> None:
    schema = schemathesis.openapi.from_url(fuzz_agent.url + "/openapi.json")
    schema = schema.exclude(path_regex="^/v1/sim/")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 10
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            nonlocal calls
            for token in (fuzz_agent.token, None):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                response = case.call(base_url=fuzz_agent.url, headers=headers)
                calls += 1
                assert response.status_code < 500, (case.method, case.path, response.text)
                case.validate_response(response, checks=CHECKS)
                if 400 <= response.status_code < 500:
                    ctype = response.headers["content-type"][0].split(";")[0]
                    assert ctype == "application/problem+json", (response.status_code,
                                                                 response.text)

        check()
    print(f"fuzz: {len(operations)} operations, {calls} requests")
