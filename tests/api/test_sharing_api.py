"""Sharing through the claims API (issue 16), in-process over a simulated L40S node with the
sharing tools played by fakes: the strict ``sharing``/``capacity``/``share_id`` fields, each
refusal naming its field, what a prepared shared device and its claim show, overcommit and
missing tools as problems."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.api.problems import PROBLEM_BASE
from agent.claims.sharing import short_id
from tests.api.test_claim_requests import TOKEN
from tests.api.test_claim_requests import Api as ClaimsApi
from tests.claims.fake_tools import FakeMps, FakeSmi, Tools, open_node


@dataclass
class Api(ClaimsApi):
    """The claims API client of test_claim_requests, with the fake sharing tools."""

    tools: Tools


async def _api(tmp_path: Path, aiohttp_client: Any, tools: Tools) -> Api:
    node = await open_node(tmp_path / "node", tools)
    (tmp_path / "tokens").write_text(f"admin:{TOKEN}:admin\n")
    (tmp_path / "tokens").chmod(0o600)
    ctx = AgentContext(node=node.node, tokens=TokenStore.load(tmp_path / "tokens"))
    client: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
    return Api(client, node, tools)


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Api]:
    made = await _api(tmp_path, aiohttp_client, Tools())
    try:
        yield made
    finally:
        await made.node.close()


def dev(ref: str = "0", **extra: Any) -> dict[str, Any]:
    return {"kind": "gpu", "device": ref, **extra}


#: A device entry and the field its 422 names.
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "unknown strategy": (dev(sharing={"strategy": "Fractional"}), "devices[0].sharing.strategy"),
    "thread percentage 0": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 0}}),
        "devices[0].sharing.mpsConfig.defaultActiveThreadPercentage"),
    "thread percentage 101": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 101}}),
        "devices[0].sharing.mpsConfig.defaultActiveThreadPercentage"),
    "thread percentage as a string": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": "50"}}),
        "devices[0].sharing.mpsConfig.defaultActiveThreadPercentage"),
    "unknown mpsConfig field": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "multiUser": True}}), "devices[0].sharing.mpsConfig.multiUser"),
    "snake_case spelling": (dev(sharing={"strategy": "MPS", "mps_config": {}}),
                            "devices[0].sharing.mps_config"),
    "mpsConfig with TimeSlicing": (dev(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
                                   "devices[0].sharing"),
    "unknown interval": (dev(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {
        "interval": "VeryLong"}}), "devices[0].sharing.timeSlicingConfig.interval"),
    "bad pinned quantity": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": "10 GB"}}),
        "devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
    "zero pinned limit": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": 0}}),
        "devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
    "pinned limit above memory": (dev(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": "64Gi"}}),
        "devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
    "bad capacity quantity": (dev(capacity={"memory": "lots"}), "devices[0].capacity.memory"),
    "capacity above the shareable memory": (dev(capacity={"memory": "45057Mi"}),
                                            "devices[0].capacity.memory"),
    "unknown capacity": (dev(capacity={"memory": "1Gi", "threads": 3}),
                         "devices[0].capacity.threads"),
    "share_id on a slice": ({"kind": "slice", "profile": "1g.10gb", "share_id": "s"},
                            "devices[0]"),
    "sharing on a slice": ({"kind": "slice", "profile": "1g.10gb",
                            "sharing": {"strategy": "MPS"}}, "devices[0]"),
    "time-slicing a share": (dev(capacity={"memory": "10Gi"}, sharing={
        "strategy": "TimeSlicing"}), "devices[0].sharing.strategy"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_sharing_is_422_naming_the_field(api: Api, case: str) -> None:
    """Each sharing or capacity the request or the device cannot honour is a 422 naming the
    field, and nothing is held or run."""
    entry, field = BAD[case]
    status, body = await api.prepare("c", entry)
    assert status == 422, body
    assert field in [e["field"] for e in body["errors"]], body
    assert api.node.ledger.holds() == [] and api.tools.mps.started == []


async def test_a_share_shows_its_limits_share_and_daemon(api: Api) -> None:
    """A prepared 10 GiB share shows its effective sharing (MPS, 22 % threads, 10240 MiB
    pinned), its share with the shareID, and the claim's running daemon."""
    status, body = await api.prepare("c-share", dev(capacity={"memory": "10Gi"},
                                                    share_id="3f2a"))
    assert status == 200, body
    (device,) = body["devices"]
    assert device["share"] == {"memory_mib": 10240, "share_id": "3f2a"}
    assert device["sharing"] == {"strategy": "MPS", "interval": None, "thread_percentage": 22,
                                 "pinned_limit_mib": 10240}
    root = str(api.node.node.settings.mps_root / short_id("c-share"))  # type: ignore[operator]
    assert body["mps"] == {"root": root, "pipe_directory": f"{root}/pipe",
                           "devices": [device["uuid"]], "state": "running", "reason": None}
    status, read = await api.call("GET", "/v1/claims/c-share")
    assert status == 200 and read["mps"] == body["mps"] and read["devices"] == body["devices"]


async def test_integer_bytes_are_a_quantity(api: Api) -> None:
    """capacity.memory and the pinned limit accept integer bytes."""
    status, body = await api.prepare("c", dev(capacity={"memory": 10 * 2**30}, sharing={
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 2**30}}))
    assert status == 200, body
    assert body["devices"][0]["sharing"]["pinned_limit_mib"] == 1024


async def test_an_overcommitting_share_is_409_saying_what_is_left(api: Api) -> None:
    """A share that would overcommit the GPU is a 409 device-busy naming the holders and the
    memory taken and left."""
    for n in range(4):
        assert (await api.prepare(f"s{n}", dev(capacity={"memory": "10Gi"})))[0] == 200
    status, body = await api.prepare("s4", dev(capacity={"memory": "10Gi"}))
    assert status == 409 and body["type"] == f"{PROBLEM_BASE}device-busy"
    assert sorted(body["holders"]) == ["s0", "s1", "s2", "s3"]
    assert "4096 MiB left" in body["detail"]


async def test_missing_tools_are_503_sharing_unavailable(tmp_path: Path,
                                                         aiohttp_client: Any) -> None:
    """Without the MPS binary, an MPS claim is a 503 sharing-unavailable naming the tool,
    with Retry-After; a plain claim still works."""
    made = await _api(tmp_path, aiohttp_client, Tools(smi=FakeSmi(), mps=FakeMps(present=False)))
    try:
        reply = await made.client.put("/v1/claims/c", json={"devices": [dev(sharing={
            "strategy": "MPS"})]}, headers={"Authorization": f"Bearer {TOKEN}"})
        body = await reply.json()
        assert reply.status == 503 and body["type"] == f"{PROBLEM_BASE}sharing-unavailable"
        assert body["tool"] == "nvidia-cuda-mps-control" and "Retry-After" in reply.headers
        assert (await made.prepare("plain", dev()))[0] == 200
    finally:
        await made.node.close()


async def test_gpus_show_share_holders_their_use_and_what_is_left(api: Api) -> None:
    """/v1/gpus/{gpu} shows a shared GPU's holders (share, shareID, memory their MPS clients
    use, daemon state) and the shareable capacity left; an unshared GPU shows none."""
    await api.prepare("a", dev(capacity={"memory": "10Gi"}, share_id="sa"))
    await api.prepare("b", dev(capacity={"memory": "20Gi"}, share_id="sb"))
    status, gpu = await api.call("GET", "/v1/gpus/0")
    assert status == 200
    # The fake daemons' one client is pid 101; pid 999 belongs to nobody's daemon.
    api.tools.used[gpu["uuid"]] = {101: 3000, 999: 5000}
    status, gpu = await api.call("GET", "/v1/gpus/0")
    assert gpu["shares"] == {"capacity_mib": 45056, "left_mib": 45056 - 30720,
                             "compute_mode": "DEFAULT", "holders": [
        {"claim": "a", "memory_mib": 10240, "share_id": "sa", "used_mib": 3000,
         "mps_state": "running"},
        {"claim": "b", "memory_mib": 20480, "share_id": "sb", "used_mib": 3000,
         "mps_state": "running"}]}
    status, other = await api.call("GET", "/v1/gpus/1")
    assert other["shares"] is None


async def test_a_share_id_without_capacity_is_the_whole_device(api: Api) -> None:
    """A shareID with no capacity consumed holds the whole GPU and echoes the ID."""
    status, body = await api.prepare("c", dev(share_id="s-1"))
    assert status == 200, body
    assert body["devices"][0]["share"] == {"memory_mib": 45056, "share_id": "s-1"}
    assert body["devices"][0]["sharing"] is None and body["mps"] is None
    status, body = await api.prepare("d", dev(capacity={"memory": "1Gi"}))
    assert status == 409
