"""Resource stability (issue 8, item 6): a bounded soak of the real agent; fds, threads and RSS
do not grow after warm-up and collection never goes stale. Long runs: ``python -m tests.soak``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.errors import ClaimUnprepared, DeviceBusy
from tests.claims.test_service import gpu
from tests.service_node import open_services
from tests.soak import Bounds, Sample, SoakResult, run_soak


@pytest.mark.slow
def test_soak_holds_fds_threads_rss_and_staleness(tmp_path: Path) -> None:
    result = run_soak(30, tmp_path / "state", collect_interval=0.5)
    print(result.summary())
    assert result.violations() == [], result.summary()
    assert len(result.samples) >= 25


def _result(fds: list[int], staleness: float = 0.1) -> SoakResult:
    samples = [Sample(float(i), n, 10, 100 * 2**20, staleness) for i, n in enumerate(fds)]
    result = SoakResult(float(len(fds)), 0.5, samples, transitions=1, claim_cycles=1)
    return result


def test_the_check_catches_growth_and_staleness() -> None:
    """The bounds bite: a steady fd leak and one stale sample are both reported."""
    assert _result([20] * 9).violations() == []
    leak = _result([20, 20, 20, 20, 21, 22, 24, 26, 28]).violations(Bounds(fds=4))
    assert len(leak) == 1 and leak[0].startswith("fds grew by 6")
    stale = _result([20] * 9, staleness=1.5).violations()
    assert len(stale) == 1 and "staleness" in stale[0]


async def test_claim_locks_do_not_pile_up(tmp_path: Path) -> None:
    """Regression (found reading the soak's claim path): a repeated or unknown unprepare and a
    refused prepare each left a per-UID lock behind for good, so a kubelet retrying unprepares
    grew the agent without bound. Now the map only holds claims with a call in flight."""
    node = await open_services(tmp_path)
    try:
        for i in range(50):
            await node.claims.unprepare(f"never-{i}")
        await node.claims.prepare("c1", [gpu("1")], {})
        await node.claims.unprepare("c1")
        await node.claims.unprepare("c1")
        with pytest.raises(ClaimUnprepared):
            await node.claims.prepare("c1", [gpu("1")], {})
        with pytest.raises(DeviceBusy):
            await asyncio.gather(*(node.claims.prepare(f"busy-{i}", [gpu("2")], {})
                                   for i in range(4)))
        await asyncio.gather(*(node.claims.unprepare(f"busy-{i}") for i in range(4)),
                             *(node.claims.unprepare("c1") for _ in range(4)))
        assert len(node.claims.locks) == 0
    finally:
        await node.close()
