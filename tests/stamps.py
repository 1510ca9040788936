"""Ordering stamps (``issued_at_ns``, CLOCK_BOOTTIME nanoseconds of this boot) for tests.

The agent refuses a stamp ahead of its boot clock and a negative one, so a test's stamps must
lie between zero and now whatever the machine's uptime: a CI VM may have booted a second ago.
``stamp(n)`` is ``n`` nanoseconds after a base taken a little before this module was
imported, so stamps increase with ``n``, are never negative and are never ahead of the clock.
"""

from __future__ import annotations

import time

#: Offsets stay below this (1 ms): no interpreter runs a test within 1 ms of boot.
SPAN_NS = 10**6
BASE = max(0, time.clock_gettime_ns(time.CLOCK_BOOTTIME) - SPAN_NS)


def stamp(offset: int) -> int:
    """The stamp ``offset`` ns after :data:`BASE` (``0 <= offset < SPAN_NS``)."""
    if not 0 <= offset < SPAN_NS:
        raise ValueError(f"a stamp offset is in [0, {SPAN_NS}), not {offset}")
    return BASE + offset
