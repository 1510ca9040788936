"""``wait_s`` of ``GET /v1/resourceslices`` (issue 22, item 11) takes seconds in ASCII digits
only, like every other query parameter: what ``float()`` also takes (spaces, underscores,
exponents, signs, other scripts' digits) is a 422 naming the field, on a real agent."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from tests.agent_process import AgentProcess, start_agent

URL = "/v1/resourceslices"
#: An ETag no answer has: the agent answers 200 at once, whatever wait_s says.
STALE = '"0000"'

REFUSED = [  # fullwidth 10, Arabic-Indic 10, Extended Arabic-Indic 5, Devanagari 5
    " 5", "5 ", "\t5", "1_0", "\uff11\uff10", "\u0661\u0660", "\u06f5", "\u096b",
    "1e1", "1E1", "+5", "-1", "-0", "61", "60.5", "nan", "NaN", "inf", "infinity", "",
    "05", "00", ".5", "5.", "0x10", "5s",
    "1.1234567", "99999", "1" * 5000,
]
ACCEPTED = ["0", "0.0", "5", "0.5", "30", "59.999999", "60", "60.000000"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    running = start_agent(tmp_path_factory.mktemp("wait") / "state")
    yield running
    running.stop(signal.SIGKILL)


def _get(agent: AgentProcess, value: str) -> tuple[int, object]:
    reply = agent.request("GET", f"{URL}?wait_s={quote(value, safe='')}",
                          headers={"If-None-Match": STALE})
    return reply.status, reply.body


@pytest.mark.parametrize("value", REFUSED, ids=ascii)
def test_wait_s_in_any_other_spelling_is_a_422_naming_it(agent: AgentProcess,
                                                          value: str) -> None:
    status, body = _get(agent, value)
    assert status == 422, (value, body)
    assert isinstance(body, dict) and body["errors"][0]["field"] == "wait_s", body


@pytest.mark.parametrize("value", ACCEPTED)
def test_wait_s_in_ascii_digits_is_taken(agent: AgentProcess, value: str) -> None:
    status, body = _get(agent, value)
    assert status == 200, (value, body)
