"""The one poll (tests/waiting.py): it returns the condition's first truthy answer, and past
its deadline fails naming what it waited for."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import until, wait_for


def test_wait_for_returns_the_first_truthy_answer() -> None:
    answers = iter([None, [], 0, "found", "later"])
    assert wait_for(lambda: next(answers), "an answer", every_s=0) == "found"


def test_a_wait_past_its_deadline_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"after 0\.01s waiting for the flag \(last: \[\]\)"):
        wait_for(list, "the flag", 0.01, every_s=0.001)


def test_an_exception_from_the_condition_ends_the_wait() -> None:
    def dead() -> bool:
        raise RuntimeError("the process exited")
    with pytest.raises(RuntimeError, match="exited"):
        wait_for(dead, "never")


async def test_until_takes_sync_and_async_conditions() -> None:
    count = itertools.count()

    async def third() -> int | None:
        n = next(count)
        return n if n >= 2 else None

    assert await until(third, "the third probe", every_s=0) == 2
    assert await until(lambda: "now", "at once") == "now"
    with pytest.raises(AssertionError, match="waiting for never"):
        await until(lambda: False, "never", 0.01, every_s=0.001)
