"""Where an on-demand slice goes (:func:`agent.claims.placement.choose`): small hand-made
cases on H100 GPUs, each pinning one step of the documented objective."""

from __future__ import annotations

import pytest

from agent.claims.placement import Candidate, Choice, choose
from agent.gpu.types import Placement
from agent.mig.geometry import Catalog, Geometry, Instance
from tests.mig.catalogs import A100_40GB, H100_80GB

# A GPU: its instances as (profile, start); the size comes from the profile.
Gpu = tuple[tuple[str, int], ...]


def gpu(*items: tuple[str, int], catalog: Catalog = H100_80GB,
        enabled: bool = True) -> tuple[Catalog, Geometry]:
    instances = []
    for name, start in items:
        size = next(p.size for p in catalog.profile(name).placements if p.start == start)
        instances.append(Instance(name, Placement(start, size)))
    return catalog, Geometry(mig_enabled=enabled, instances=tuple(instances))


def candidates(*gpus: tuple[Catalog, Geometry]) -> list[Candidate]:
    return [Candidate(index, catalog, geometry) for index, (catalog, geometry) in enumerate(gpus)]


EMPTY = gpu()

# (GPUs, profile, start asked, expected (GPU, start) or None, why)
CASES = [
    ([EMPTY], "1g.10gb", None, (0, 4),
     "keeps slices 0-3 for a 4g/3g; at 6 it would strand slice 7"),
    ([EMPTY], "2g.20gb", None, (0, 4), "keeps slices 0-3, the only place of a 4g"),
    ([EMPTY], "1g.20gb", None, (0, 6),
     "keeps 0-3 for a 4g and, at 6, every 2g placement too (at 4 it takes one)"),
    ([EMPTY], "3g.40gb", None, (0, 4), "a 3g at 0 would take the 4g's only placement"),
    ([EMPTY, EMPTY], "7g.80gb", None, (0, 0), "tie: the lowest GPU index"),
    ([EMPTY, gpu(("3g.40gb", 4))], "1g.10gb", None, (1, 0),
     "fills the used GPU rather than start an empty one (room for a 7g)"),
    ([gpu(("4g.40gb", 0))], "1g.10gb", None, (0, 4),
     "no stranded slice before room for a 2g: at 6 slice 7 would be lost"),
    ([gpu(("1g.10gb", 4), ("1g.10gb", 5))], "1g.10gb", None, (0, 6),
     "room for a 4g/3g (slices 0-3) comes before a stranded slice 7"),
    ([gpu(("3g.40gb", 0), ("1g.10gb", 4), ("1g.10gb", 5)), gpu(("2g.20gb", 4))], "1g.10gb",
     None, (0, 6), "GPU 1 at 0-3 would break its free half; at 6 it ties GPU 0: best fit"),
    ([gpu(("1g.10gb", 0)), gpu(("1g.10gb", 0), ("1g.10gb", 1))], "1g.10gb", None, (0, 1),
     "beside a used slot, whose 2g pair is broken already, before best fit"),
    ([gpu(("1g.10gb", 0), ("3g.40gb", 4)), gpu(("1g.20gb", 0), ("3g.40gb", 4))], "1g.20gb",
     None, (1, 2), "same room lost on both: best fit, GPU 1 is left full"),
    ([gpu(("1g.10gb", 0)), gpu(("1g.10gb", 0))], "1g.10gb", None, (0, 1),
     "equal GPUs: the lowest index, then the lowest start"),
    ([EMPTY], "1g.10gb", 6, (0, 6), "an asked start is kept even where it strands a slice"),
    ([EMPTY], "3g.40gb", 2, None, "no 3g placement starts at 2"),
    ([gpu(("7g.80gb", 0))], "1g.10gb", None, None, "a full GPU takes nothing"),
    ([gpu(("4g.40gb", 0)), gpu(("1g.10gb", 6))], "4g.40gb", None, (1, 0),
     "one 4g per GPU: only GPU 1 can take it"),
    ([gpu(("1g.10gb+me", 5)), EMPTY], "1g.10gb+me", None, (1, 4), "one +me instance per GPU"),
    ([gpu(("3g.40gb", 4), ("1g.20gb", 0), ("1g.10gb", 2)), gpu(("3g.40gb", 4), ("1g.10gb", 0))],
     "1g.10gb", None, (0, 3),
     "best fit takes GPU 0's last 1g slot: a +me profile adds no room of its own to keep"),
    ([gpu(catalog=A100_40GB), EMPTY], "3g.40gb", None, (1, 4),
     "a GPU whose catalog lacks the profile is skipped"),
    ([gpu(enabled=False), EMPTY], "1g.10gb", None, (1, 4), "a GPU with MIG disabled is skipped"),
    ([], "1g.10gb", None, None, "no GPU at all"),
]


@pytest.mark.parametrize(("gpus", "profile", "start", "expected", "why"), CASES,
                         ids=[case[-1] for case in CASES])
def test_choose(gpus: list[tuple[Catalog, Geometry]], profile: str, start: int | None,
                expected: tuple[int, int] | None, why: str) -> None:
    choice = choose(candidates(*gpus), profile, start)
    if expected is None:
        assert choice is None, why
    else:
        index, at = expected
        size = H100_80GB.profile(profile).placements[0].size
        assert choice == Choice(index, Placement(at, size)), why


def test_the_choice_ignores_the_order_of_the_candidates() -> None:
    """GPU indexes, not list positions, break ties."""
    gpus = candidates(EMPTY, gpu(("1g.10gb", 0)), EMPTY)
    assert choose(gpus, "1g.10gb") == choose(list(reversed(gpus)), "1g.10gb") \
        == Choice(1, Placement(1, 1))


def test_choices_fill_a_gpu_without_wasting_a_slice() -> None:
    """Seven 1g.10gb one after another fill one GPU's seven slots before the next GPU."""
    gpus = [EMPTY, EMPTY]
    for _ in range(7):
        choice = choose(candidates(*gpus), "1g.10gb")
        assert choice is not None and choice.index == 0
        catalog, geometry = gpus[0]
        gpus[0] = catalog, Geometry(mig_enabled=True, instances=(
            *geometry.instances, Instance("1g.10gb", choice.placement)))
    assert gpus[0][1].used_slices() == 0b0111_1111
    assert choose(candidates(*gpus), "1g.10gb") == Choice(1, Placement(4, 1))
