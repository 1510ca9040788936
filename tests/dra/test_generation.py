"""The pool generation: unchanged content keeps it, a change raises it, a restart never
lowers it, and an unreadable record restarts above any earlier value."""

from __future__ import annotations

import time
from pathlib import Path

from agent.dra.generation import PoolGeneration, fingerprint

from .conftest import MakeEnv


def test_generation_follows_content_and_survives_restarts(tmp_path: Path) -> None:
    path = tmp_path / "dra" / "pool.json"
    pool = PoolGeneration(path)
    assert pool.for_content(fingerprint({"a": 1})) == 1
    assert pool.for_content(fingerprint({"a": 1})) == 1
    assert pool.for_content(fingerprint({"a": 2})) == 2
    again = PoolGeneration(path)
    assert again.for_content(fingerprint({"a": 2})) == 2
    assert again.for_content(fingerprint({"a": 1})) == 3


def test_unreadable_record_never_goes_back(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    PoolGeneration(path).for_content("x")
    path.write_text("{not json")
    pool = PoolGeneration(path)
    assert pool.problem is not None
    assert pool.for_content("x") > int(time.time()) - 5
    assert list(tmp_path.glob("pool.json.corrupt-*"))


async def test_a_mig_change_raises_the_generation(make_env: MakeEnv) -> None:
    """Rendering twice gives the same generation; a new MIG instance gives the next one."""
    env = await make_env("dgx-h100", setup=lambda e: e.make_mig(0, [(19, 0)]))
    first = (await env.slices.slices((1, 35)))[0]["spec"]["pool"]["generation"]
    assert (await env.slices.slices((1, 34)))[0]["spec"]["pool"]["generation"] == first
    env.make_mig(0, [(19, 1)])
    second = (await env.slices.slices((1, 35)))[0]["spec"]["pool"]["generation"]
    assert second == first + 1
