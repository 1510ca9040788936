"""Disk trouble (issue 8, item 7): with the state directory full (ENOSPC) or read-only
(EROFS), every mutating call fails with :class:`StorageUnavailable` (a 507 problem in the
API), nothing is half-written, nothing is acknowledged that is not durable, and the agent
works again once space returns. Injected at the ``agent.durable`` seam: ``os.write`` /
``os.fsync`` / ``os.open`` raise, the way a full or read-only filesystem answers."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.api.problems import PROBLEM_CONTENT_TYPE, problem_middleware, problem_of
from agent.claims.checkpoint import decode
from agent.durable import DurableMap, write_atomic
from agent.errors import StorageUnavailable
from agent.events import EventLog
from agent.mig.geometry import DesiredProfiles
from agent.mig.journal import TransitionJournal
from agent.mig.transition import DrainPolicy, TransitionState
from tests.claims.test_service import gpu, slice_
from tests.service_node import open_services
from tests.waiting import until


class Disk:
    """Switchable disk trouble for the durable-write seam."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.error: int | None = None
        real_write, real_fsync, real_open = os.write, os.fsync, os.open

        def write(fd: int, data: Any) -> int:
            if self.error == errno.ENOSPC:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            if self.error == errno.ENOSPC:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        def open_(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
            if self.error == errno.EROFS and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, mode, **kw)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "open", open_)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    yield Disk(monkeypatch)


TROUBLE = [errno.ENOSPC, errno.EROFS]


@pytest.mark.parametrize("error", TROUBLE, ids=["ENOSPC", "EROFS"])
def test_write_atomic_leaves_old_file_and_no_temp(tmp_path: Path, disk: Disk, error: int) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, b"old")
    disk.error = error
    with pytest.raises(StorageUnavailable) as info:
        write_atomic(path, b"new" * 10_000)
    assert info.value.errno == error and isinstance(info.value, OSError)
    assert problem_of(info.value).status == 507 and errno.errorcode[error] in info.value.detail
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    disk.error = None
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"


@pytest.mark.parametrize("error", TROUBLE, ids=["ENOSPC", "EROFS"])
async def test_durable_map_change_not_kept_when_not_durable(tmp_path: Path, disk: Disk,
                                                            error: int) -> None:
    dmap = DurableMap(tmp_path / "m.json")
    await dmap.set("a", 1)
    disk.error = error
    with pytest.raises(StorageUnavailable):
        await dmap.set("b", 2)
    with pytest.raises(StorageUnavailable):
        await dmap.delete("a")
    disk.error = None
    assert DurableMap(tmp_path / "m.json").items() == [("a", 1)]
    assert dmap.items() == [("a", 1)]  # memory agrees with disk: nothing unacknowledged kept


@pytest.mark.parametrize("error", TROUBLE, ids=["ENOSPC", "EROFS"])
async def test_claims_fail_cleanly_and_recover(tmp_path: Path, disk: Disk, error: int) -> None:
    node = await open_services(tmp_path)
    try:
        await node.claims.prepare("kept", [gpu("0")], {})
        await node.mig_to(2, ["3g.40gb"])
        before = (await node.gpu(2)).mig_devices
        disk.error = error
        for uid, requests in (("c1", [gpu("1")]), ("c2", [slice_("1g.10gb", "2")])):
            with pytest.raises(StorageUnavailable):
                await node.claims.prepare(uid, requests, {})
        with pytest.raises(StorageUnavailable):
            await node.claims.unprepare("kept")
        disk.error = None
        # Nothing half-written: the checkpoint on disk holds exactly the acknowledged claim,
        # no spec file or slice was left for the refused ones.
        on_disk = decode((node.state / "claims.checkpoint").read_bytes())
        assert on_disk.claims["kept"].state in ("prepare_completed", "unprepare_started")
        assert set(on_disk.claims) == {"kept"}
        specs = sorted(p.name for p in node.cdi_dir.glob("*claim_*.json"))
        assert specs == ["k8s.gpu.nodeagent.dev-claim_kept.json"]
        assert (await node.gpu(2)).mig_devices == before  # the slice was not left behind
        # (A temp file of a transition history write still in flight goes when it ends.)
        await until(lambda: not list(node.state.rglob(".*.tmp.*")),
                    "no temp file left in the state directory")
        # Space is back: the same calls succeed and are durable.
        await node.claims.prepare("c1", [gpu("1")], {})
        await node.claims.unprepare("kept")
        on_disk = decode((node.state / "claims.checkpoint").read_bytes())
        assert set(on_disk.claims) == {"c1"}
    finally:
        await node.close()


@pytest.mark.parametrize("error", TROUBLE, ids=["ENOSPC", "EROFS"])
async def test_geometry_change_refused_untouched_and_recovers(tmp_path: Path, disk: Disk,
                                                              error: int) -> None:
    node = await open_services(tmp_path)
    try:
        await node.mig_to(3, ["3g.40gb"])
        before = (await node.gpu(3)).mig_devices
        disk.error = error
        try:
            outcome = await node.mig.request(await node.gpu(3),
                                             DesiredProfiles.of(["1g.10gb"] * 7), DrainPolicy())
            assert outcome.transition is not None
            await outcome.transition.finished.wait()
            assert outcome.transition.state != TransitionState.SUCCEEDED
        except StorageUnavailable:
            pass  # refused up front: also clean
        disk.error = None
        assert (await node.gpu(3)).mig_devices == before  # old geometry, exactly
        assert not list(TransitionJournal(node.state / "mig" / "journal").directory.glob("*"))
        # The transition history is written in the background once the transition ended: a
        # temp file of that write in flight goes when it ends; one left behind never does.
        await until(lambda: not list(node.state.rglob(".*.tmp.*")),
                    "no temp file left in the state directory")
        await node.mig_to(3, ["1g.10gb"] * 7)
        assert len((await node.gpu(3)).mig_devices) == 7
    finally:
        await node.close()


def test_event_history_is_bounded() -> None:
    events = EventLog(capacity=50)
    for i in range(500):
        events.append("x", f"event {i}")
    assert len(events.since(0)) == 50


async def test_api_maps_storage_errors_to_507_problem(aiohttp_client: Callable[..., Any],
                                                      tmp_path: Path, disk: Disk) -> None:
    async def mutate(request: web.Request) -> web.Response:
        write_atomic(tmp_path / "x", b"data")
        return web.json_response({})

    async def raw(request: web.Request) -> web.Response:  # an OSError outside write_atomic
        raise OSError(errno.ENOSPC, "No space left on device")

    app = web.Application(middlewares=[problem_middleware])
    app.router.add_post("/m", mutate)
    app.router.add_post("/r", raw)
    client: TestClient[Any, Any] = await aiohttp_client(app)
    disk.error = errno.ENOSPC
    for path in ("/m", "/r"):
        resp = await client.post(path)
        assert resp.status == 507, path
        assert resp.content_type == PROBLEM_CONTENT_TYPE
        body = await resp.json()
        assert body["type"].endswith("/insufficient-storage") and "ENOSPC" in body["detail"]
    disk.error = None
    assert (await client.post("/m")).status == 200
