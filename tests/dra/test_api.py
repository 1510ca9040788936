"""GET /v1/resourceslices over HTTP in process: the ETag, 304 for a current one, holding a
request with wait_s until the content changes, and the query's validation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.gpu.backend import Backend
from agent.gpu.sim.node import SimulatedNode
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import Hold
from agent.settings import resolve
from agent.wiring import Node, build_node

Started = tuple[TestClient[Any, Any], Node]
URL = "/v1/resourceslices"


@pytest.fixture
async def served(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Callable[
        ..., Awaitable[Started]]]:
    sims: list[SimulatedNode] = []

    async def start(*, dynamic_mig: bool = False) -> Started:
        settings = resolve({"simulate": "dgx-h100", "state_dir": str(tmp_path / "state"),
                            "dynamic_mig": dynamic_mig or None}, env={})
        sim = SimulatedNode("dgx-h100", settings.state_dir, settings.proc_root)
        sims.append(sim)
        node = build_node(settings, Backend(nvml=sim.nvml, name="simulated:dgx-h100",
                                            sim=sim, sys_root=sim.sys_root))
        await node.session.initialise()
        await node.inventory.load()
        await node.ledger.register(node.inventory.gpus)
        await node.topology.load()
        node.readiness.reconciled = True
        node.readiness.set(None)
        client = await aiohttp_client(build_app(AgentContext(node=node,
                                                             tokens=TokenStore.empty())))
        return client, node

    yield start
    for sim in sims:
        sim.close()


async def test_an_etag_names_the_content(served: Callable[..., Awaitable[Started]]) -> None:
    """Every answer has an ETag; the same content the same one, for every version; a
    current one answers 304 without a body, a stale or a different version's one 200 (with
    dynamic MIG, 1.34 lays the shared counters out in the devices' slices, 1.35 apart)."""
    client, _ = await served(dynamic_mig=True)
    first = await client.get(URL)
    assert first.status == 200
    etag = first.headers["ETag"]
    assert etag.startswith('"') and etag.endswith('"')
    assert (await client.get(URL)).headers["ETag"] == etag
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = await client.get(URL, headers={"If-None-Match": header})
        assert again.status == 304, header
        assert again.headers["ETag"] == etag
        assert await again.read() == b""
    assert (await client.get(URL, headers={"If-None-Match": '"stale"'})).status == 200
    old = await client.get(URL + "?kubernetes=1.34", headers={"If-None-Match": etag})
    assert old.status == 200 and old.headers["ETag"] != etag
    for version in ("1.36", "1.37", "1.40"):
        newer = await client.get(f"{URL}?kubernetes={version}")
        assert newer.status == 200, version
        assert newer.headers["ETag"] == etag  # 1.35's layout, the same content


async def test_a_wait_ends_in_304_without_a_change(
        served: Callable[..., Awaitable[Started]]) -> None:
    """With nothing changing, a request waiting wait_s seconds answers 304 after them."""
    client, _ = await served()
    etag = (await client.get(URL)).headers["ETag"]
    started = time.monotonic()
    reply = await client.get(URL + "?wait_s=0.6", headers={"If-None-Match": etag})
    assert reply.status == 304
    # Not before wait_s; the upper bound only tells it from a wait of the 30 s default.
    assert 0.6 <= time.monotonic() - started < 20


def _holding(node: Node, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a request waits in the slice service for a change."""
    held = asyncio.Event()
    wait = node.resource_slices.wait_for_change

    async def waiting(*args: Any, **kwargs: Any) -> Any:
        held.set()
        return await wait(*args, **kwargs)

    monkeypatch.setattr(node.resource_slices, "wait_for_change", waiting)
    return held


@pytest.mark.parametrize("change", ["quarantine", "claim", "drain mark"])
async def test_a_change_wakes_a_waiting_request(
        served: Callable[..., Awaitable[Started]], change: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A quarantine, a claim's hold on a whole GPU or a transition's marks answer a waiting
    request with the new content (the GPU's placements tainted, or gone) and a new ETag,
    long before its 20 s wait ends (how soon is bench/dra.py's republish figure, not a timed
    test)."""
    client, node = await served(dynamic_mig=True)
    held = _holding(node, monkeypatch)
    first = await client.get(URL)
    etag = first.headers["ETag"]
    waiting = asyncio.create_task(client.get(URL + "?wait_s=20",
                                             headers={"If-None-Match": etag}))
    await asyncio.wait_for(held.wait(), 10)
    assert not waiting.done()
    gpu = node.inventory.gpus[3]
    if change == "quarantine":
        await node.ledger.quarantine(gpu.uuid, "test")
    elif change == "claim":  # what a claim made over REST holds (the scheduler cannot see it)
        node.ledger.take(Hold("c-1", DeviceKey(gpu.uuid)), name="gpu-3")
    else:
        await node.ledger.begin_transition(gpu.uuid)
        seven = next(p for p in gpu.profiles if p.name == "7g.80gb")
        node.ledger.name_transition(gpu.uuid, "t-1", create=seven.placements)
    reply = await asyncio.wait_for(waiting, 10)
    assert reply.status == 200
    assert reply.headers["ETag"] != etag
    body = await reply.json()
    names = {d["name"] for s in body["items"] for d in s["spec"].get("devices") or []}
    assert any(n.startswith("gpu-3-mig-") for n in
               {d["name"] for s in (await first.json())["items"]
                for d in s["spec"].get("devices") or []})
    if change == "quarantine":  # published still, every device of the GPU tainted
        gpu3 = [d for s in body["items"] for d in s["spec"].get("devices") or []
                if d["name"].startswith("gpu-3")]
        assert gpu3 and all(t["key"] == "gpu.nodeagent.dev/quarantined"
                            and t["effect"] == "NoSchedule"
                            for d in gpu3 for t in d["taints"])
    else:
        assert not any(n.startswith("gpu-3-mig-") for n in names)


@pytest.mark.parametrize("value", ["-1", "61", "lots", "nan", "inf", ""])
async def test_a_bad_wait_is_422_naming_it(served: Callable[..., Awaitable[Started]],
                                           value: str) -> None:
    client, _ = await served()
    reply = await client.get(f"{URL}?wait_s={value}", headers={"If-None-Match": "*"})
    assert reply.status == 422
    assert (await reply.json())["errors"][0]["field"] == "wait_s"


async def test_slices_use_nvidias_words_and_the_inventory_keeps_its_own(
        served: Callable[..., Awaitable[Started]]) -> None:
    """The slices say Hopper and Nvidia; /v1/gpus still reports the inventory's values."""
    client, _ = await served()
    body = await (await client.get(URL)).json()
    device = body["items"][0]["spec"]["devices"][0]["attributes"]
    assert device["architecture"] == {"string": "Hopper"}
    assert device["brand"] == {"string": "Nvidia"}
    gpus = await (await client.get("/v1/gpus")).json()
    first = gpus[0] if isinstance(gpus, list) else gpus["gpus"][0]
    assert first["architecture"] == "hopper" and first["brand"] == "nvidia"
