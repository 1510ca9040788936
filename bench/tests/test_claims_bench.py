"""The claims and packing benchmarks run on tiny inputs and their results add up (so they
cannot rot). Timings are not asserted: only what does not depend on the machine's speed."""

from __future__ import annotations

import pytest

from bench import claims, packing
from bench.mig_disruption import read_catalog


@pytest.mark.slow
def test_claims_bench_runs_and_group_commits() -> None:
    # Its own temporary directory, not tmp_path: the agent's Unix socket path under a pytest
    # worker's tmp_path can pass the 107 bytes AF_UNIX allows.
    result = claims.run(clients=(1, 4), cycles=8, samples=6, concurrent=(1, 16), repeats=1)
    assert [(r.scenario, r.clients) for r in result.http] == [
        (s, n) for s in ("gpu", "mig", "slice") for n in (1, 4)]
    for row in result.http:
        assert row.pool == (8 if row.scenario == "gpu" else 56)
        assert row.cycles + row.errors >= 8 and row.cycles > 0
        assert 0 < row.prepare_p50_s <= row.prepare_p99_s
        assert 0 < row.unprepare_p50_s <= row.unprepare_p99_s
        assert row.throughput > 0
    assert all(r.errors == 0 for r in result.http if r.scenario != "slice")
    assert result.scaling("gpu") is not None

    p = result.in_process
    assert p.samples == 6 and p.write_bytes > 0
    assert 0 < p.write_p50_s <= p.write_p99_s
    assert 0 < p.prepare_p50_s <= p.prepare_p99_s
    assert p.prepare_vs_write > 0
    batches = {(b.kind, b.concurrent): b for b in p.batches}
    assert set(batches) == {("gpu", 1), ("mig", 1), ("mig", 16), ("slice", 1), ("slice", 16)}
    one = batches[("gpu", 1)]
    # One prepare alone: one checkpoint write (group commit of one) and its two fsyncs (file,
    # directory); the claim's CDI spec is written atomically but not fsync'd (rebuilt at start).
    assert (one.prepares, one.errors, one.prepare_checkpoint_writes) == (1, 0, 1)
    assert one.prepare_fsyncs == 2
    # Its unprepare (no slice): one commit.
    assert one.unprepare_checkpoint_writes == 1
    # 16 at once share checkpoint writes: far fewer than 16.
    many = batches[("mig", 16)]
    assert many.prepares == 16 and many.errors == 0
    assert many.prepare_checkpoint_writes < many.prepares
    assert many.writes_per_prepare < 1
    # A slice is recorded before it is made, and again once made: two commits alone.
    assert batches[("slice", 1)].prepare_checkpoint_writes == 2

    lines = claims.report(result, "/tmp (ext4)")
    assert lines[0].startswith("# Claims") and "CPUs" in lines[0] and "Python" in lines[0]
    assert any(line.startswith("server-side prepare p99 / durable write p99") for line in lines)
    assert sum(line.startswith("throughput 4 clients / 1 client") for line in lines) == 3


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert claims.percentile(values, 50) == 50.0
    assert claims.percentile(values, 99) == 99.0
    assert claims.percentile([3.0], 99) == 3.0
    assert claims.percentile([], 50) == 0.0


def test_packing_bench_runs_and_the_best_is_the_best() -> None:
    result = packing.run(seed=3, arrivals=150, small_traces=6, small_requests=9)
    assert result.large_events == 300 and result.small_requests == 9
    assert [a.policy for a in result.large] == ["ours", "first-fit", "no fragmentation"]
    assert [a.policy for a in result.small] == [
        "ours", "first-fit", "no fragmentation", packing.BEST_ONLINE, packing.BEST_REQUESTS,
        packing.BEST_CAPACITY]
    for a in result.large + result.small[:4]:
        assert a.requests == sum(n for _, _, n in a.by_profile)
        assert a.admitted == sum(k for _, k, _ in a.by_profile)
        assert 0 < (a.fraction or 0) <= 1 and 0 < (a.capacity_fraction or 0) <= 1
    best_n = result.small_of(packing.BEST_REQUESTS).admitted
    best_c = result.small_of(packing.BEST_CAPACITY).admitted_capacity
    assert best_n is not None and best_c is not None
    for policy in ("ours", "first-fit", packing.BEST_ONLINE):
        assert (result.small_of(policy).admitted or 0) <= best_n
        assert (result.small_of(policy).admitted_capacity or 0) <= best_c
    assert 0 < result.ours_vs_best <= 1 and 0 < result.ours_vs_best_capacity <= 1
    assert 0 < result.online_vs_best <= 1
    lines = packing.report(result)
    assert lines[0].startswith("# Packing") and "CPUs" in lines[0]
    assert any(line.startswith("ours / best placement") for line in lines)


def test_packing_is_reproducible_from_the_seed() -> None:
    first = packing.run(seed=5, arrivals=80, small_traces=2, small_requests=6)
    again = packing.run(seed=5, arrivals=80, small_traces=2, small_requests=6)
    assert first.large == again.large and first.small == again.small


def _trace(*requests: tuple[float, float, str], gpus: int = 1) -> packing.Trace:
    events: list[packing.Event] = []
    for request, (arrive, leave, profile) in enumerate(requests):
        events += [(arrive, 1, request, profile), (leave, 0, request, profile)]
    return packing.Trace(seed=0, gpus=gpus, load=0.0, events=tuple(sorted(events)))


def test_exact_search_on_a_hand_made_trace() -> None:
    _, catalog = read_catalog("dgx-h100")
    one = {p.name: 1 for p in catalog.profiles}
    size = {p.name: p.memory_slices for p in catalog.profiles}
    # One GPU: a 1g.10gb that stays, then a 4g.40gb (only at slice 0) while it is there.
    # First-fit puts the 1g at slice 0 and turns the 4g away; keeping slice 0 free admits both.
    trace = _trace((0.0, 10.0, "1g.10gb"), (1.0, 2.0, "4g.40gb"))
    assert [a for _, a in packing.replay(catalog, trace, packing.first_fit)] == [True, False]
    assert [a for _, a in packing.replay(catalog, trace, packing.ours)] == [True, True]
    assert packing.optimum(catalog, trace, one) == 2
    assert packing.optimum(catalog, trace, size) == 5
    # Two 7g.80gb at once on one GPU: the second never fits, whatever the placement.
    busy = _trace((0.0, 3.0, "7g.80gb"), (1.0, 2.0, "7g.80gb"))
    assert packing.optimum(catalog, busy, one) == 1
    assert [a for _, a in packing.repacked(catalog, busy)] == [True, False]


def test_best_online_on_hand_made_traces() -> None:
    _, catalog = read_catalog("dgx-h100")
    # A 1g.10gb, then a 4g.40gb while it is there: the best online rule, not knowing which
    # profile comes next, keeps slice 0-3 free for it anyway (a 4g or a 3g may come).
    trace = _trace((0.0, 10.0, "1g.10gb"), (1.0, 2.0, "4g.40gb"))
    assert packing.best_online(catalog, [trace], 1.0) == [[("1g.10gb", True),
                                                           ("4g.40gb", True)]]
    # What fits nowhere is turned away, as for the policies.
    busy = _trace((0.0, 3.0, "7g.80gb"), (1.0, 2.0, "7g.80gb"))
    assert [a for _, a in packing.best_online(catalog, [busy], 1.0)[0]] == [True, False]


@pytest.mark.parametrize("preset", ["dgx-h100"])
def test_slice_symmetries_of_the_h100(preset: str) -> None:
    _, catalog = read_catalog(preset)
    group = packing.symmetries(catalog)
    assert len(group) == 16  # swap 0-1, 2-3, 4-5, and the pairs 0-1 / 2-3
    identity = {key: (key[1], key[2]) for key in group[0]}
    assert identity in group
