"""Choosing k GPUs out of n candidates (pure; weights are integer pair bandwidths).

The objective, compared lexicographically (bigger is better):
1. the bottleneck: the smallest pair bandwidth inside the set (a ring or all-reduce runs at
   the pace of its slowest link, Koordinator's point in ``topology.md`` 4);
2. the total pair bandwidth inside the set;
3. NUMA locality: fewer NUMA nodes spanned;
4. what stays free: the sum, over the GPUs left over, of each one's best link to another
   left-over GPU, so a one-GPU request takes the GPU whose loss hurts the remaining sets
   least (the orphan of a broken NVLink pair before a member of an intact one, the
   request of k8s-device-plugin #1193);
5. the lowest positions (deterministic answers).

Exact search works on classes of interchangeable GPUs ("twins": the same NUMA node and the
same bandwidth to every other candidate, like the eight GPUs of one socket on an NVSwitch
board): it chooses how many GPUs to take from each class, with branch and bound on the
bottleneck and an upper bound on the total. That is exhaustive, so the answer is optimal,
and it is fast for the symmetric boards real nodes are. When the number of such choices
exceeds ``EXACT_LIMIT`` (irregular topologies far beyond 16 GPUs), a greedy start from
several seeds followed by one-for-one swaps until nothing improves is used instead, and the
answer says it may not be optimal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb

INF = 1 << 62
#: Most class-multiplicity vectors the exact search may face (C(16, 8) = 12,870, so every
#: choice among 16 GPUs is exact whatever their wiring).
EXACT_LIMIT = 20_000
_MAX_SEEDS = 12


@dataclass(frozen=True)
class Choice:
    members: tuple[int, ...]
    """Chosen candidate positions, ascending."""
    bottleneck: int | None
    """Smallest pair weight in the set; None for a single GPU."""
    total: int
    numa_count: int
    optimal: bool
    method: str
    """``exact`` or ``greedy``."""
    evaluated: int
    """Complete sets compared (exact) or swap candidates tried (greedy)."""


@dataclass
class _Class:
    members: list[int]
    numa: int | None
    intra: int
    forced: bool = False


def _numa_key(value: int | None) -> int:
    return -1 if value is None else value


def twin_classes(weights: Sequence[Sequence[int]], numa: Sequence[int | None],
                 must: Sequence[int]) -> list[_Class]:
    """Partition the candidates into interchangeable groups; each must-include candidate is a
    class of its own that the search has to take."""
    n = len(numa)
    forced = set(must)
    classes: list[_Class] = [_Class([m], numa[m], 0, forced=True) for m in sorted(forced)]
    buckets: dict[tuple[object, ...], list[_Class]] = {}
    for i in range(n):
        if i in forced:
            continue
        row = weights[i]
        signature = (_numa_key(numa[i]), tuple(sorted(row[k] for k in range(n) if k != i)))
        placed = False
        for cls in buckets.setdefault(signature, []):
            r = cls.members[0]
            wr = weights[r]
            if all(row[k] == wr[k] for k in range(n) if k not in (i, r)):
                if len(cls.members) == 1:
                    cls.intra = row[r]
                cls.members.append(i)
                placed = True
                break
        if not placed:
            cls = _Class([i], numa[i], 0)
            buckets[signature].append(cls)
            classes.append(cls)
    return classes


def count_choices(sizes: Sequence[int], r: int, cap: int = EXACT_LIMIT + 1) -> int:
    """How many multiplicity vectors (m_c <= size_c, sum r) there are, capped at ``cap``."""
    ways = [1] + [0] * r
    for size in sizes:
        new = [0] * (r + 1)
        for total in range(r + 1):
            if ways[total]:
                for m in range(min(size, r - total) + 1):
                    new[total + m] = min(cap, new[total + m] + ways[total])
        ways = new
    return ways[r]


def evaluate(weights: Sequence[Sequence[int]], numa: Sequence[int | None],
             members: Sequence[int]) -> tuple[int, int, int]:
    """(bottleneck (INF for one GPU), total, NUMA nodes spanned) of a set."""
    bottleneck, total = INF, 0
    for pos, a in enumerate(members):
        row = weights[a]
        for b in members[pos + 1:]:
            w = row[b]
            total += w
            bottleneck = min(bottleneck, w)
    return bottleneck, total, len({_numa_key(numa[m]) for m in members})


def leftover(weights: Sequence[Sequence[int]], free: Sequence[int]) -> int:
    """Sum over the free GPUs of each one's best link to another free GPU."""
    score = 0
    for a in free:
        row = weights[a]
        score += max((row[b] for b in free if b != a), default=0)
    return score


def choose(weights: Sequence[Sequence[int]], numa: Sequence[int | None], count: int,
           must: Sequence[int] = (), *, exact_limit: int = EXACT_LIMIT) -> Choice:
    """The best ``count`` candidates (positions into ``weights``) including ``must``."""
    n = len(numa)
    if not 1 <= count <= n or len(set(must)) > count:
        raise ValueError(f"cannot choose {count} of {n} with {len(set(must))} required")
    classes = twin_classes(weights, numa, must)
    free = [c for c in classes if not c.forced]
    r = count - sum(1 for c in classes if c.forced)
    if count_choices([len(c.members) for c in free], r) <= exact_limit:
        return _exact(weights, numa, classes, count)
    return _greedy(weights, numa, classes, count)


# -- exact ----------------------------------------------------------------------------------


class _Exact:
    def __init__(self, weights: Sequence[Sequence[int]], numa: Sequence[int | None],
                 classes: list[_Class], count: int) -> None:
        self.weights = weights
        self.numa = numa
        forced = [c for c in classes if c.forced]
        free = [c for c in classes if not c.forced]

        def strength(c: _Class) -> tuple[int, int]:
            row = weights[c.members[0]]
            best = max([c.intra] + [row[k] for k in range(len(numa)) if k not in c.members])
            return -best, c.members[0]

        free.sort(key=strength)
        self.classes = forced + free
        self.n_forced = len(forced)
        size = len(self.classes)
        self.sizes = [len(c.members) for c in self.classes]
        reps = [c.members[0] for c in self.classes]
        self.w = [[0 if a == b else weights[reps[a]][reps[b]] for b in range(size)]
                  for a in range(size)]
        self.intra = [c.intra for c in self.classes]
        self.numa_keys = [_numa_key(c.numa) for c in self.classes]
        self.count = count
        # Largest weight any pair touching class >= pos can have (for the total's bound).
        self.suffix_max = [0] * (size + 1)
        for pos in range(size - 1, -1, -1):
            own = max([self.intra[pos]] + self.w[pos])
            self.suffix_max[pos] = max(own, self.suffix_max[pos + 1])
        self.suffix_size = [0] * (size + 1)
        for pos in range(size - 1, -1, -1):
            self.suffix_size[pos] = self.suffix_size[pos + 1] + self.sizes[pos]
        self.best: tuple[int, int, int, int] | None = None
        #: (bottleneck, total) no answer can fall below: the best found so far, or a greedy
        #: answer's before the search starts (only strictly worse branches are cut).
        self.bound: tuple[int, int] | None = None
        self.best_m: list[int] = []
        self.best_members: tuple[int, ...] = ()
        self.evaluated = 0

    def run(self) -> Choice:
        size = len(self.classes)
        self._dfs(0, [0] * size, self.count, INF, 0, 0, [INF] * size, [0] * size)
        members = tuple(sorted(self.best_members))
        bottleneck, total, numa_count = evaluate(self.weights, self.numa, members)
        return Choice(members=members, bottleneck=None if bottleneck == INF else bottleneck,
                      total=total, numa_count=numa_count, optimal=True, method="exact",
                      evaluated=self.evaluated)

    def _dfs(self, pos: int, m: list[int], r: int, bottleneck: int,  # noqa: PLR0917 - hot
             total: int, chosen: int, acc_min: list[int], acc_sum: list[int]) -> None:
        if r == 0:
            self._leaf(m, bottleneck, total)
            return
        if pos == len(self.classes) or self.suffix_size[pos] < r:
            return
        bound = self.bound
        if bound is not None:
            if bottleneck < bound[0]:
                return
            # Only GPUs whose links to the chosen ones (and, for a second one of a class, to
            # each other) reach the best bottleneck can still join; enough of them left?
            threshold = bound[0]
            gains: list[int] = []
            for d in range(pos, len(self.classes)):
                if chosen and acc_min[d] < threshold:
                    continue
                units = self.sizes[d] if self.intra[d] >= threshold else 1
                gains.extend([acc_sum[d]] * min(units, r))
            if len(gains) < r:
                return
            if bottleneck == threshold:
                gains.sort(reverse=True)
                ceiling = total + sum(gains[:r]) + comb(r, 2) * self.suffix_max[pos]
                if ceiling < bound[1]:
                    return
                # Neither bottleneck nor total can beat the best any more: a set already
                # spanning more NUMA nodes than the best one cannot win.
                best = self.best
                if best is not None and ceiling <= bound[1] and not self._numa_feasible(
                        pos, m, r, -best[2]):
                    return
        size = self.sizes[pos]
        low = 1 if pos < self.n_forced else 0
        for take in range(min(size, r), low - 1, -1):
            new_b, new_t = bottleneck, total
            if take:
                if chosen:
                    new_b = min(new_b, acc_min[pos])
                    new_t += take * acc_sum[pos]
                if take >= 2:
                    new_b = min(new_b, self.intra[pos])
                    new_t += comb(take, 2) * self.intra[pos]
                if self.bound is not None and new_b < self.bound[0]:
                    continue
                row = self.w[pos]
                next_min = [min(a, b) for a, b in zip(acc_min, row, strict=True)]
                next_sum = [a + take * b for a, b in zip(acc_sum, row, strict=True)]
            else:
                next_min, next_sum = acc_min, acc_sum
            m[pos] = take
            self._dfs(pos + 1, m, r - take, new_b, new_t, chosen + take, next_min, next_sum)
            m[pos] = 0

    def _numa_feasible(self, pos: int, m: list[int], r: int, limit: int) -> bool:
        """Whether ``r`` more GPUs from classes >= ``pos`` can join without the set spanning
        more than ``limit`` NUMA nodes."""
        used = {self.numa_keys[c] for c in range(pos) if m[c]}
        if len(used) > limit:
            return False
        room = 0
        fresh: dict[int, int] = {}
        for c in range(pos, len(self.classes)):
            key = self.numa_keys[c]
            if key in used:
                room += self.sizes[c]
            else:
                fresh[key] = fresh.get(key, 0) + self.sizes[c]
        room += sum(sorted(fresh.values(), reverse=True)[:limit - len(used)])
        return room >= r

    def _leaf(self, m: list[int], bottleneck: int, total: int) -> None:
        self.evaluated += 1
        if self.bound is not None and (bottleneck, total) < self.bound:
            return
        numa_count = len({_numa_key(self.classes[c].numa)
                          for c in range(len(m)) if m[c]})
        best = self.best
        head = (bottleneck, total, -numa_count)
        if best is not None and head < best[:3]:
            return
        left = self._leftover(m)
        key = (bottleneck, total, -numa_count, left)
        members = tuple(sorted(p for c, take in enumerate(m) if take
                               for p in self.classes[c].members[:take]))
        if best is None or key > best or (key == best and members < self.best_members):
            self.best, self.best_m, self.best_members = key, list(m), members
            self.bound = (bottleneck, total)

    def _leftover(self, m: list[int]) -> int:
        rem = [s - t for s, t in zip(self.sizes, m, strict=True)]
        score = 0
        for c, count in enumerate(rem):
            if not count:
                continue
            best = self.intra[c] if count >= 2 else 0
            row = self.w[c]
            for d, other in enumerate(rem):
                if other and d != c and row[d] > best:
                    best = row[d]
            score += count * best
        return score


def _exact(weights: Sequence[Sequence[int]], numa: Sequence[int | None],
           classes: list[_Class], count: int) -> Choice:
    search = _Exact(weights, numa, classes, count)
    if count > 2:
        start = _greedy(weights, numa, classes, count, seeds=2)
        if start.bottleneck is not None:
            search.bound = (start.bottleneck, start.total)
    return search.run()


# -- greedy + local improvement ------------------------------------------------------------


def _greedy(weights: Sequence[Sequence[int]], numa: Sequence[int | None],
            classes: list[_Class], count: int, *, seeds: int = _MAX_SEEDS) -> Choice:
    n = len(numa)
    must = sorted(c.members[0] for c in classes if c.forced)
    starts: list[list[int]]
    if must:
        starts = [must]
    else:
        def strength(c: _Class) -> tuple[int, int]:
            row = weights[c.members[0]]
            return -max(row), -sum(row)

        ranked = sorted((c for c in classes), key=strength)[:seeds]
        starts = [[c.members[0]] for c in ranked]
    best: tuple[tuple[int, int, int], tuple[int, ...]] | None = None
    tried = 0
    for seed in starts:
        grown = _grow(weights, numa, seed, count, n)
        members, swaps = _improve(weights, numa, grown, set(must), n)
        tried += swaps
        b, t, k = evaluate(weights, numa, members)
        key = ((b, t, -k), members)
        if best is None or key[0] > best[0] or (key[0] == best[0] and key[1] < best[1]):
            best = key
    assert best is not None
    members_t = best[1]
    b, t, k = evaluate(weights, numa, members_t)
    return Choice(members=members_t, bottleneck=None if b == INF else b, total=t,
                  numa_count=k, optimal=False, method="greedy", evaluated=tried)


def _grow(weights: Sequence[Sequence[int]], numa: Sequence[int | None], seed: list[int],
          count: int, n: int) -> list[int]:
    chosen = list(seed)
    in_set = [False] * n
    min_to = [INF] * n
    sum_to = [0] * n
    for a in chosen:
        in_set[a] = True
        row = weights[a]
        for c in range(n):
            min_to[c] = min(min_to[c], row[c])
            sum_to[c] += row[c]
    bottleneck = evaluate(weights, numa, chosen)[0]
    nodes = {_numa_key(numa[a]) for a in chosen}
    while len(chosen) < count:
        pick, pick_key = -1, None
        for c in range(n):
            if in_set[c]:
                continue
            key = (min(bottleneck, min_to[c]), sum_to[c],
                   0 if _numa_key(numa[c]) in nodes else -1, -c)
            if pick_key is None or key > pick_key:
                pick, pick_key = c, key
        chosen.append(pick)
        in_set[pick] = True
        bottleneck = min(bottleneck, min_to[pick])
        nodes.add(_numa_key(numa[pick]))
        row = weights[pick]
        for c in range(n):
            min_to[c] = min(min_to[c], row[c])
            sum_to[c] += row[c]
    return chosen


def _improve(weights: Sequence[Sequence[int]], numa: Sequence[int | None],
             members: list[int], fixed: set[int], n: int) -> tuple[tuple[int, ...], int]:
    """Swap one member for one outsider while that improves (bottleneck, total, NUMA)."""
    current = list(members)
    b, t, k = evaluate(weights, numa, current)
    key = (b, t, -k)
    tried = 0
    improved = True
    rounds = 0
    while improved and rounds < 4 * n:
        improved = False
        rounds += 1
        inside = set(current)
        for out in [a for a in current if a not in fixed]:
            rest = [a for a in current if a != out]
            rest_b, rest_t, _ = evaluate(weights, numa, rest)
            for c in range(n):
                if c in inside:
                    continue
                tried += 1
                row = weights[c]
                cand_b = min([rest_b] + [row[a] for a in rest])
                if cand_b < key[0]:
                    continue
                cand_t = rest_t + sum(row[a] for a in rest)
                nodes = len({_numa_key(numa[a]) for a in rest} | {_numa_key(numa[c])})
                cand = (cand_b, cand_t, -nodes)
                if cand > key:
                    current = [*rest, c]
                    key = cand
                    improved = True
                    break
            if improved:
                break
    return tuple(sorted(current)), tried
