"""The pool generation: unchanged content keeps it, a change raises it, a restart never
lowers it, and an unreadable record restarts above any earlier value."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.dra.generation import PoolGeneration, fingerprint

from .conftest import MakeEnv


async def test_generation_follows_content_and_survives_restarts(tmp_path: Path) -> None:
    path = tmp_path / "dra" / "pool.json"
    pool = PoolGeneration(path)
    assert await pool.for_content(fingerprint({"a": 1})) == 1
    assert await pool.for_content(fingerprint({"a": 1})) == 1
    assert await pool.for_content(fingerprint({"a": 2})) == 2
    again = PoolGeneration(path)
    assert await again.for_content(fingerprint({"a": 2})) == 2
    assert await again.for_content(fingerprint({"a": 1})) == 3


@pytest.mark.parametrize("damage", ["not-json", "directory"])
async def test_unreadable_record_never_goes_back(tmp_path: Path, damage: str) -> None:
    """A damaged pool.json, or a directory where it belongs, is kept aside and the generation
    restarts above any earlier value."""
    path = tmp_path / "pool.json"
    await PoolGeneration(path).for_content("x")
    path.unlink()
    if damage == "directory":
        path.mkdir()
    else:
        path.write_text("{not json")
    pool = PoolGeneration(path)
    assert pool.problem is not None
    assert await pool.for_content("x") > int(time.time()) - 5
    assert _kept_aside(tmp_path)


def _kept_aside(directory: Path) -> list[Path]:
    return list(directory.glob("pool.json.corrupt-*"))


async def test_concurrent_new_content_takes_one_number_each(tmp_path: Path) -> None:
    """Renders racing with new content never share or skip a generation, and what is
    returned is what a restart reads back."""
    pool = PoolGeneration(tmp_path / "pool.json")
    got = await asyncio.gather(*(pool.for_content(f"c{i}") for i in range(5)))
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert await PoolGeneration(tmp_path / "pool.json").for_content("c4") == 5


async def test_a_mig_change_raises_the_generation(make_env: MakeEnv) -> None:
    """Rendering twice gives the same generation; a new MIG instance gives the next one."""
    env = await make_env("dgx-h100", setup=lambda e: e.make_mig(0, [(19, 0)]))
    first = (await env.slices.slices((1, 35)))[0]["spec"]["pool"]["generation"]
    assert (await env.slices.slices((1, 34)))[0]["spec"]["pool"]["generation"] == first
    env.make_mig(0, [(19, 1)])
    second = (await env.slices.slices((1, 35)))[0]["spec"]["pool"]["generation"]
    assert second == first + 1
