"""The DRA benchmark runs at tiny size against the real Kubernetes components and its
figures add up (so it cannot rot). Timings are not asserted, except the one ordering no
machine can break: a p50 is at most its p99."""

from __future__ import annotations

import pytest

from bench import dra
from tests.k8s.harness import NEWEST, build


@pytest.fixture(scope="module", autouse=True)
def harness_built() -> None:
    """The k8s-harness of the newest version (a skip without Go, a failure under CI=true)."""
    build(NEWEST)


@pytest.mark.slow
def test_dra_bench_runs_every_part_and_every_prepare_reaches_the_plugin() -> None:
    result = dra.run(samples=2, single_rounds=1, batches=1, isolation_batches=1,
                     republish_repeats=1, allocator_runs=2)
    p = result.prepare
    assert p is not None
    assert set(p.rows) == {(k, path) for k in dra.KINDS for path in dra.PATHS}
    for stats in p.rows.values():
        assert stats.n == 2 and 0 < stats.p50 <= stats.p99 <= stats.max
    # Kubelet's cache never answered for the plugin: it counted every prepare sent to it.
    assert set(p.reached) == {"memory", "apiserver"}
    for sent, seen in p.reached.values():
        assert sent == seen == 2 * 2 * (1 + 2)  # kinds x (gRPC, kubelet) x (warm-up + samples)

    c = result.concurrency
    assert c is not None
    assert c.single.n == c.concurrent.n == 56 and c.idle.n == 49
    assert c.busy.n in (0, 49) and c.busy_batches in (0, 1) and c.gpu7_busy_s > 0
    assert all(seconds > 0 for seconds in c.cpu_per_cycle)

    r = result.republish
    assert r is not None
    assert len(r.geometry) == len(r.geometry_after_end) == 1 and r.geometry[0] > 0
    assert set(r.xid) == set(r.reset) == set(dra.XIDS)

    assert len(result.allocator) == 3
    assert all(s.n == 2 and s.p50 > 0 for s in result.allocator.values())

    lines = dra.report(result)
    assert lines[0].startswith("# DRA") and "CPUs" in lines[0] and "Python" in lines[0]
    assert sum("hop over REST" in line for line in lines) == 2
    assert any(line.startswith("56 MIG claims, all 56 prepares at once") for line in lines)
    assert sum(line.startswith("republish:") for line in lines) == 2 + 2 * len(dra.XIDS)
    assert sum(line.startswith("allocator") for line in lines) == 3
