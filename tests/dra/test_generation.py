"""The pool generation: unchanged content keeps it, a change raises it, a restart never
lowers it, and an unreadable record restarts above any earlier value."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from agent.dra.generation import PoolGeneration, fingerprint
from agent.errors import StorageUnavailable

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
    first = (await env.resource_slices.of_version((1, 35)))[0]["spec"]["pool"]["generation"]
    assert (await env.resource_slices.of_version((1, 34)))[0]["spec"]["pool"]["generation"] == first
    env.make_mig(0, [(19, 1)])
    second = (await env.resource_slices.of_version((1, 35)))[0]["spec"]["pool"]["generation"]
    assert second == first + 1


async def test_a_new_generation_is_fsyncd_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/resourceslices may raise the generation: its fsync runs in a worker thread."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        threads.append(threading.get_ident())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    await PoolGeneration(tmp_path / "pool.json").for_content("x")
    assert threads and loop_thread not in threads


async def test_a_generation_that_cannot_be_written_is_never_handed_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full disk the render fails (507) and the number is not used: after space returns
    the same content gets the number a restart would also give it."""
    pool = PoolGeneration(tmp_path / "pool.json")
    assert await pool.for_content("a") == 1
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageUnavailable):
        await pool.for_content("b")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert await PoolGeneration(tmp_path / "pool.json").for_content("a") == 1
    assert await pool.for_content("b") == 2
