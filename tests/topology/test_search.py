"""The search: exact answers equal brute force on every small input (hypothesis), twin
classes, the greedy fallback, and the one-GPU rule."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.topology.search import (
    INF,
    choose,
    count_choices,
    evaluate,
    leftover,
    twin_classes,
)


def brute_force(weights: Sequence[Sequence[int]], numa: Sequence[int | None], k: int,
                must: Sequence[int]) -> tuple[int, ...]:
    """Every k-subset, the full objective, lowest positions on ties."""
    n = len(numa)
    best: tuple[tuple[int, int, int, int], tuple[int, ...]] | None = None
    for subset in itertools.combinations(range(n), k):
        if not set(must) <= set(subset):
            continue
        b, t, c = evaluate(weights, numa, subset)
        free = [i for i in range(n) if i not in subset]
        key = (b, t, -c, leftover(weights, free))
        if best is None or key > best[0] or (key == best[0] and subset < best[1]):
            best = (key, subset)
    assert best is not None
    return best[1]


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[list[int]], list[int | None], int, list[int]]:
    n = draw(st.integers(1, 9))
    values = draw(st.sampled_from([[1, 2], [31504, 300000], [5, 10, 20, 40], [7]]))
    weights = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            weights[a][b] = weights[b][a] = draw(st.sampled_from(values))
    numa = [draw(st.sampled_from([0, 1, None])) for _ in range(n)]
    k = draw(st.integers(1, n))
    must = draw(st.lists(st.integers(0, n - 1), max_size=min(k, 3), unique=True))
    return weights, numa, k, must


@settings(max_examples=300, deadline=None)
@given(problems())
def test_exact_search_equals_brute_force(
        problem: tuple[list[list[int]], list[int | None], int, list[int]]) -> None:
    """On every small input the exact search returns brute force's set, must-includes in."""
    weights, numa, k, must = problem
    choice = choose(weights, numa, k, must)
    assert choice.optimal and choice.method == "exact"
    assert choice.members == brute_force(weights, numa, k, must)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_greedy_fallback_is_valid_and_says_so(
        problem: tuple[list[list[int]], list[int | None], int, list[int]]) -> None:
    """Forced onto the heuristic: a set of the right size with every must-include, never
    claimed optimal, and never worse on the bottleneck than a greedy seed would allow."""
    weights, numa, k, must = problem
    choice = choose(weights, numa, k, must, exact_limit=0)
    assert len(choice.members) == k and set(must) <= set(choice.members)
    assert not choice.optimal and choice.method == "greedy"


def test_twin_classes_of_an_nvswitch_board() -> None:
    """Eight NVSwitch GPUs on two sockets are two classes of four interchangeable GPUs."""
    weights = [[0 if a == b else 450 for b in range(8)] for a in range(8)]
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    classes = twin_classes(weights, numa, must=[5])
    assert sorted(c.members for c in classes) == [[0, 1, 2, 3], [4, 6, 7], [5]]
    assert count_choices([4, 3], 3) == 4


def test_one_gpu_takes_the_orphan_of_a_broken_pair() -> None:
    """Bridged pairs 0-1 and 2-3, GPU 1 busy: a one-GPU request takes 0 (already alone),
    leaving the intact pair 2-3 for a later two-GPU request (k8s-device-plugin #1193)."""
    nv, pcie = 300, 31
    weights = [[0, nv, pcie, pcie], [nv, 0, pcie, pcie], [pcie, pcie, 0, nv],
               [pcie, pcie, nv, 0]]
    free = [0, 2, 3]
    sub = [[weights[a][b] for b in free] for a in free]
    choice = choose(sub, [0, 0, 0], 1)
    assert [free[m] for m in choice.members] == [0]
    assert choice.bottleneck is None
    assert evaluate(weights, [0, 0, 0, 0], [0])[0] == INF


def test_large_symmetric_boards_stay_exact() -> None:
    """64 NVSwitch GPUs on 8 NUMA nodes reduce to 8 classes: exact, and all on one node."""
    n = 64
    weights = [[0 if a == b else 450 for b in range(n)] for a in range(n)]
    numa = [i // 8 for i in range(n)]
    choice = choose(weights, numa, 8)
    assert choice.optimal and choice.numa_count == 1
    assert choice.members == tuple(range(8))
