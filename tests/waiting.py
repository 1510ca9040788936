"""The one way a test waits for something it cannot be told about: poll a condition until it
holds, with a deadline whose failure names what was waited for.

Tests never sleep to let something happen (tests/test_tests.py refuses it): a sleep passes
on an idle machine and fails on a loaded one, and it costs its full length every run. The
pause between two probes here is the only sleep test code has without a stated reason.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Long enough for a loaded 2-core machine; a condition that holds returns at once.
TIMEOUT_S = 10.0
EVERY_S = 0.02


def _timed_out(what: str, timeout_s: float, last: object) -> str:
    shown = "" if last in (None, False) else f" (last: {last!r})"
    return f"timed out after {timeout_s}s waiting for {what}{shown}"


def wait_for(check: Callable[[], T], what: str, timeout_s: float = TIMEOUT_S, *,
             every_s: float = EVERY_S) -> T:
    """``check()``'s first truthy result, probed every ``every_s``; AssertionError naming
    ``what`` (and the last result) once ``timeout_s`` passed without one. An exception from
    ``check`` ends the wait with that exception (a process that died, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(what, timeout_s, result))
        time.sleep(every_s)


async def until(check: Callable[[], T | Awaitable[T]], what: str,
                timeout_s: float = TIMEOUT_S, *, every_s: float = EVERY_S) -> T:
    """:func:`wait_for` on the event loop: ``check`` may be sync or async, and the loop runs
    between probes."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(what, timeout_s, result))
        await asyncio.sleep(every_s)
