"""The claims API for the kubelet plugin (issue 14), in-process over a simulated DGX H100:
ordering stamps that tell a late retry from a legitimate re-prepare, admin-access holds,
the device-node check before a prepare is answered, resource_version, and token scopes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from tests import stamps
from tests.service_node import ServiceNode, open_services
from tests.waiting import until

PLUGIN, READER = "p1", "r1"
TOKENS = "plugin:p1:claims\nreader:r1:read\n"


@dataclass
class Api:
    client: TestClient[Any, Any]
    node: ServiceNode

    async def call(self, method: str, path: str, body: Any = None, *, token: str = PLUGIN,
                   params: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        reply = await self.client.request(method, path, json=body, params=params,
                                          headers={"Authorization": f"Bearer {token}"})
        text = await reply.text()
        return reply.status, json.loads(text) if text else None, dict(reply.headers)

    async def prepare(self, uid: str, device: str = "0", stamp: int | None = None, *,
                      admin: bool = False, **extra: Any) -> tuple[int, Any, dict[str, str]]:
        body: dict[str, Any] = {"devices": [{"kind": "gpu", "device": device,
                                             **({"admin_access": True} if admin else {})}],
                                **extra}
        if stamp is not None:
            body["issued_at_ns"] = stamps.stamp(stamp)
        return await self.call("PUT", f"/v1/claims/{uid}", body)

    async def unprepare(self, uid: str, stamp: int | None = None) -> int:
        params = {"issued_at_ns": str(stamps.stamp(stamp))} if stamp is not None else None
        status, _, _ = await self.call("DELETE", f"/v1/claims/{uid}", params=params)
        return status

    async def holds(self, gpu: str) -> list[dict[str, Any]]:
        _, body, _ = await self.call("GET", f"/v1/gpus/{gpu}", token=READER)
        holds: list[dict[str, Any]] = body["holds"]
        return holds


ApiMaker = Callable[..., Awaitable[Api]]


@pytest.fixture
async def make_api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[ApiMaker]:
    nodes: list[ServiceNode] = []

    async def make(**settings: Any) -> Api:
        node = await open_services(tmp_path / f"n{len(nodes)}", settings=settings)
        nodes.append(node)
        (tmp_path / "tokens").write_text(TOKENS)
        (tmp_path / "tokens").chmod(0o600)
        ctx = AgentContext(node=node.node, tokens=TokenStore.load(tmp_path / "tokens"))
        client: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
        return Api(client, node)

    yield make
    for node in nodes:
        await node.close()


@pytest.fixture
async def api(make_api: ApiMaker) -> Api:
    return await make_api()


# -- ordering stamps ---------------------------------------------------------------------------

# Each step: ("P" prepare | "U" unprepare, stamp or None, expected status); then whether the
# claim is prepared at the end.
ORDERING = {
    "a prepare sent before the unprepare and arriving after it is refused":
        ([("P", 10, 200), ("U", 20, 204), ("P", 15, 409)], False),
    "a prepare sent after the unprepare prepares anew, with the same allocation":
        ([("P", 10, 200), ("U", 20, 204), ("P", 30, 200)], True),
    "a prepare stamped exactly as the unprepare is a late retry":
        ([("P", 10, 200), ("U", 20, 204), ("P", 20, 409)], False),
    "a shared claim can be unprepared and re-prepared again and again":
        ([("P", 10, 200), ("U", 20, 204), ("P", 30, 200), ("U", 40, 204), ("P", 50, 200)],
         True),
    "an unprepare older than the claim's prepare is a no-op":
        ([("P", 30, 200), ("U", 20, 204)], True),
    "an idempotent retry moves the claim's stamp on, so an older unprepare is ignored":
        ([("P", 10, 200), ("P", 30, 200), ("U", 20, 204)], True),
    "an unprepare at or after the claim's stamp unprepares it":
        ([("P", 10, 200), ("U", 10, 204)], False),
    "an unprepare of an unknown claim refuses older prepares, not newer ones":
        ([("U", 20, 204), ("P", 10, 409), ("P", 30, 200)], True),
    "repeated unprepares of an unknown claim keep the newest stamp":
        ([("U", 20, 204), ("U", 40, 204), ("U", 30, 204), ("P", 35, 409), ("P", 41, 200)],
         True),
    "without stamps a tombstone refuses every prepare (today's rule)":
        ([("P", None, 200), ("U", None, 204), ("P", None, 409)], False),
    "an unstamped tombstone refuses a stamped prepare: nothing to order by":
        ([("P", 10, 200), ("U", None, 204), ("P", 30, 409)], False),
    "a stamped tombstone refuses an unstamped prepare":
        ([("P", 10, 200), ("U", 20, 204), ("P", None, 409)], False),
    "a stamped unprepare of an unstamped claim unprepares it":
        ([("P", None, 200), ("U", 5, 204), ("P", 6, 200)], True),
}


@pytest.mark.parametrize(("steps", "prepared"), ORDERING.values(), ids=ORDERING.keys())
async def test_stamps_order_prepares_and_unprepares(api: Api, steps: list[tuple[str, int | None,
                                                                                  int]],
                                                    prepared: bool) -> None:
    """Prepares and unprepares of one claim UID are answered by the order their stamps say
    they were issued in, and by today's tombstone rule when either has no stamp."""
    for number, (op, stamp, expected) in enumerate(steps):
        if op == "P":
            status, body, _ = await api.prepare("shared", "2", stamp)
            if expected == 409:
                assert body["type"].endswith("/claim-unprepared"), (number, body)
        else:
            status = await api.unprepare("shared", stamp)
        assert status == expected, (number, op, stamp)
    status, _, _ = await api.call("GET", "/v1/claims/shared")
    assert status == (200 if prepared else 404)
    assert bool(await api.holds("2")) == prepared
    assert (api.node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_shared.json").exists() == prepared


async def test_claim_shows_its_stamp_and_resource_version(api: Api) -> None:
    """A prepared claim shows its newest stamp and the resource_version it was prepared from."""
    status, body, _ = await api.prepare("c1", "1", 7,
                                        metadata={"namespace": "ns", "name": "claim",
                                                  "resource_version": "123456"})
    assert status == 200
    assert body["issued_at_ns"] == stamps.stamp(7)
    assert body["metadata"] == {"namespace": "ns", "name": "claim", "resource_version": "123456"}
    await api.prepare("c1", "1", 9, metadata={"resource_version": "123999"})
    _, shown, _ = await api.call("GET", "/v1/claims/c1")
    assert shown["issued_at_ns"] == stamps.stamp(9)
    assert shown["metadata"]["resource_version"] == "123456"  # kept from the first prepare


BAD_STAMPS = [
    ("PUT", {"issued_at_ns": -1}, None, "issued_at_ns"),
    ("PUT", {"issued_at_ns": "12"}, None, "issued_at_ns"),
    ("PUT", {"issued_at_ns": 2**62}, None, "issued_at_ns"),  # ahead of this boot's clock
    ("PUT", {"metadata": {"resource_version": "x" * 65}}, None, "metadata.resource_version"),
    ("DELETE", None, {"issued_at_ns": "abc"}, "issued_at_ns"),
    ("DELETE", None, {"issued_at_ns": "-5"}, "issued_at_ns"),
    ("DELETE", None, {"issued_at_ns": str(2**62)}, "issued_at_ns"),
]


@pytest.mark.parametrize(("method", "extra", "params", "field"), BAD_STAMPS)
async def test_bad_stamps_are_422_naming_the_field(api: Api, method: str,
                                                   extra: dict[str, Any] | None,
                                                   params: dict[str, str] | None,
                                                   field: str) -> None:
    """A stamp that is not a non-negative integer of this boot's clock, or an over-long
    resource_version, is a 422 naming the field, and changes nothing."""
    body = {"devices": [{"kind": "gpu", "device": "0"}], **(extra or {})} \
        if method == "PUT" else None
    status, problem, _ = await api.call(method, "/v1/claims/c1", body, params=params)
    assert status == 422, problem
    assert any(field in e["field"] for e in problem["errors"]), problem
    assert (await api.call("GET", "/v1/claims/c1"))[0] == 404


async def test_unknown_query_parameter_on_unprepare_is_refused(api: Api) -> None:
    """A misspelt stamp parameter is a 400, never an unstamped unprepare."""
    await api.prepare("c1", "0", 10)
    status, problem, _ = await api.call("DELETE", "/v1/claims/c1", params={"issued_at": "1"})
    assert status == 400 and "issued_at_ns" in problem["detail"]
    assert (await api.call("GET", "/v1/claims/c1"))[0] == 200


# -- admin access ------------------------------------------------------------------------------

async def test_admin_access_shares_the_device_with_its_holder(api: Api) -> None:
    """An admin-access claim gets a held device (and its CDI spec) without taking it from its
    holder; it blocks nobody, counts in no availability, and shows as an admin hold."""
    assert (await api.prepare("job", "3"))[0] == 200
    status, monitor, _ = await api.prepare("dcgm", "3", admin=True)
    assert status == 200
    assert monitor["devices"][0]["admin_access"] is True
    assert monitor["devices"][0]["cdi_devices"] == ["k8s.gpu.nodeagent.dev/claim=dcgm-gpu-3"]
    assert (api.node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_dcgm.json").exists()
    assert {(h["claim"], h["kind"]) for h in await api.holds("3")} == {
        ("job", "exclusive"), ("dcgm", "admin")}
    status, busy, _ = await api.prepare("other", "3")
    assert status == 409 and busy["holders"] == ["job"]
    _, gpu, _ = await api.call("GET", "/v1/gpus/3", token=READER)
    assert gpu["availability"]["holders"] == ["job"]
    # The holder leaves; the monitor stays; a new exclusive claim gets the device beside it.
    assert await api.unprepare("job") == 204
    _, gpu, _ = await api.call("GET", "/v1/gpus/3", token=READER)
    assert gpu["availability"]["available"] is True
    assert (await api.prepare("next", "3"))[0] == 200
    assert (await api.prepare("dcgm2", "3", admin=True))[0] == 200


async def test_admin_access_is_not_for_slices(api: Api) -> None:
    """admin_access on a slice made on demand is a 422 naming the device request."""
    status, problem, _ = await api.call("PUT", "/v1/claims/m", {"devices": [
        {"kind": "slice", "profile": "1g.10gb", "admin_access": True}]})
    assert status == 422 and problem["errors"][0]["field"].startswith("devices")


async def test_a_transition_destroying_an_admin_held_device_makes_that_claim_lost(
        api: Api) -> None:
    """An admin hold blocks no geometry change; when the change destroys its MIG device the
    admin claim becomes lost, its hold released and its CDI spec removed."""
    node = api.node
    await node.mig_to(4, ["3g.40gb", "3g.40gb"])
    mig = (await node.gpu(4)).mig_devices[0]
    assert (await api.prepare("watch", mig.uuid, admin=True))[0] == 200
    await node.mig_to(4, ["7g.80gb"])  # would fail with policy "fail" if the hold blocked it
    claim = await _lost(api, "watch")  # the claims service reacts to the change right after it
    assert "destroyed" in claim["lost_reason"]
    assert await api.holds("4") == []
    assert not (node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_watch.json").exists()
    assert await api.unprepare("watch") == 204


async def _lost(api: Api, uid: str) -> Any:
    """The claim, once the claims service has found it lost."""
    async def lost() -> Any:
        _, claim, _ = await api.call("GET", f"/v1/claims/{uid}")
        return claim if claim["state"] == "lost" else None
    return await until(lost, f"claim {uid} to be lost")


# -- device nodes ------------------------------------------------------------------------------

def _node(api: Api, rel: str) -> Path:
    return Path(api.node.sim.dev_root) / rel


async def _nothing_prepared(api: Api, uid: str, gpu: str) -> None:
    assert (await api.call("GET", f"/v1/claims/{uid}"))[0] == 404
    assert await api.holds(gpu) == []
    assert not (api.node.cdi_dir / f"k8s.gpu.nodeagent.dev-claim_{uid}.json").exists()


MISSING = [
    ("the GPU's own node", "dev/nvidia5", "/dev/nvidia5"),
    ("the control node", "dev/nvidiactl", "/dev/nvidiactl"),
    ("the UVM node", "dev/nvidia-uvm", "/dev/nvidia-uvm"),
]


@pytest.mark.parametrize(("rel", "path"), [(r, p) for _, r, p in MISSING],
                         ids=[n for n, _, _ in MISSING])
async def test_prepare_with_a_missing_device_node_fails_503_leaving_nothing(
        make_api: ApiMaker, rel: str, path: str) -> None:
    """A prepare whose spec would name an absent device node waits the configured time, then
    answers 503 device-nodes-missing with Retry-After, naming the node, with nothing
    prepared; once the node exists the same prepare succeeds."""
    api = await make_api(device_node_wait_s=0.2)
    _node(api, rel).unlink()
    started = time.monotonic()
    status, problem, headers = await api.prepare("c1", "5", 10)
    assert time.monotonic() - started >= 0.2
    assert status == 503 and problem["type"].endswith("/device-nodes-missing"), problem
    assert problem["missing"] == [path] and problem["claim"] == "c1"
    assert int(headers["Retry-After"]) >= 1
    await _nothing_prepared(api, "c1", "5")
    _node(api, rel).touch()
    assert (await api.prepare("c1", "5", 11))[0] == 200


async def test_prepare_waits_for_a_node_that_appears(make_api: ApiMaker) -> None:
    """A node the driver creates while the prepare waits lets the prepare succeed."""
    api = await make_api(device_node_wait_s=5.0)
    node = _node(api, "dev/nvidia6")
    node.unlink()
    loop = asyncio.get_running_loop()
    loop.call_later(0.15, node.touch)
    status, _, _ = await api.prepare("c1", "6")
    assert status == 200


async def test_slice_whose_gpu_node_is_absent_is_destroyed_again(make_api: ApiMaker) -> None:
    """A slice made for a claim whose GPU's device node is absent is destroyed again: the
    503 leaves no instance, no hold, no claim and no spec."""
    api = await make_api(device_node_wait_s=0.1)
    await api.node.mig_to(1, [])
    _node(api, "dev/nvidia1").unlink()
    status, problem, _ = await api.call("PUT", "/v1/claims/s1", {"devices": [
        {"kind": "slice", "profile": "1g.10gb", "gpu": "1"}]})
    assert status == 503 and problem["type"].endswith("/device-nodes-missing")
    assert problem["missing"] == ["/dev/nvidia1"]
    assert (await api.node.gpu(1)).mig_devices == ()
    await _nothing_prepared(api, "s1", "1")


async def test_absent_capability_nodes_do_not_hold_a_slice_back(make_api: ApiMaker) -> None:
    """MIG capability nodes are made on demand on real hosts and the spec carries their
    major and minor, so their absence on the host does not delay a prepare."""
    api = await make_api(device_node_wait_s=0.1)
    await api.node.mig_to(1, [])
    for cap in _node(api, "dev/nvidia-caps").iterdir():
        cap.unlink()
    status, claim, _ = await api.call("PUT", "/v1/claims/s1", {"devices": [
        {"kind": "slice", "profile": "1g.10gb", "gpu": "1"}]})
    assert status == 200, claim
    assert len((await api.node.gpu(1)).mig_devices) == 1


async def test_a_failed_prepare_keeps_the_tombstone_it_would_have_superseded(
        make_api: ApiMaker) -> None:
    """A re-prepare that fails for missing nodes puts the claim's tombstone back: an older
    late retry is still refused after it."""
    api = await make_api(device_node_wait_s=0.05)
    await api.prepare("c1", "7", 10)
    await api.unprepare("c1", 20)
    _node(api, "dev/nvidia7").unlink()
    assert (await api.prepare("c1", "7", 30))[0] == 503
    _node(api, "dev/nvidia7").touch()
    assert (await api.prepare("c1", "7", 15))[0] == 409
    assert (await api.prepare("c1", "7", 31))[0] == 200


# -- scopes ------------------------------------------------------------------------------------

SCOPES = [
    ("GET", "/v1/resourceslices", PLUGIN, 200),
    ("GET", "/v1/resourceslices", READER, 200),
    ("GET", "/v1/claims", PLUGIN, 200),
    ("GET", "/v1/claims/none", PLUGIN, 404),
    ("GET", "/v1/gpus", PLUGIN, 403),  # claims suffices only for the plugin's own reads
    ("GET", "/v1/gpus", READER, 200),
    ("DELETE", "/v1/claims/none", READER, 403),
    ("DELETE", "/v1/claims/none", PLUGIN, 204),
]


@pytest.mark.parametrize(("method", "path", "token", "expected"), SCOPES)
async def test_a_claims_token_reads_what_the_plugin_reads_under_auth_read(
        make_api: ApiMaker, method: str, path: str, token: str, expected: int) -> None:
    """With --auth-read a claims-scope token reads the slices and the claims (and nothing
    else); a read token still reads them and still cannot unprepare."""
    api = await make_api(auth_read=True)
    status, body, _ = await api.call(method, path, token=token)
    assert status == expected, body


async def test_a_whole_gpu_admin_claim_blocks_no_mode_change(api: Api) -> None:
    """An admin claim on a whole GPU does not stop MIG being turned on there; its device (the
    GPU's node) still exists, so the claim stays prepared."""
    assert (await api.prepare("watch", "5", admin=True))[0] == 200
    await api.node.mig_to(5, ["7g.80gb"])
    # The claims service checks every admin claim after each change: once a later change has
    # lost another one, the check that saw GPU 5 in MIG mode has run.
    await api.node.mig_to(4, ["3g.40gb", "3g.40gb"])
    probe = (await api.node.gpu(4)).mig_devices[0]
    assert (await api.prepare("probe", probe.uuid, admin=True))[0] == 200
    await api.node.mig_to(4, ["7g.80gb"])
    await _lost(api, "probe")
    _, claim, _ = await api.call("GET", "/v1/claims/watch")
    assert claim["state"] == "prepare_completed"
    assert [h["kind"] for h in await api.holds("5")] == ["admin"]


async def test_a_mig_claim_answers_its_profile_instance_ids_and_placement(api: Api) -> None:
    """A prepared MIG device, existing or made on demand, answers its profile, GPU and compute
    instance IDs and placement (the plugin writes them into the claim's device status); a
    full GPU answers none."""
    node = api.node
    await node.mig_to(4, ["3g.40gb", "1g.10gb"])
    existing = next(m for m in (await node.gpu(4)).mig_devices if m.profile == "1g.10gb")
    status, body, _ = await api.prepare("static", existing.uuid)
    assert status == 200, body
    [prepared] = body["devices"]
    assert prepared["mig"] == {"profile": "1g.10gb", "gi_id": existing.gi_id,
                               "ci_id": existing.ci_id,
                               "placement": {"start": existing.placement.start,
                                             "size": existing.placement.size}}
    status, body, _ = await api.call("PUT", "/v1/claims/made", {"devices": [
        {"kind": "slice", "profile": "1g.10gb", "gpu": "4"}]})
    assert status == 200, body
    [made] = body["devices"]
    instance = next(m for m in (await node.gpu(4)).mig_devices if m.uuid == made["uuid"])
    assert made["mig"] == {"profile": "1g.10gb", "gi_id": instance.gi_id,
                           "ci_id": instance.ci_id,
                           "placement": {"start": instance.placement.start, "size": 1}}
    status, body, _ = await api.prepare("whole", "0")
    assert status == 200 and body["devices"][0]["mig"] is None, body
    _, listed, _ = await api.call("GET", "/v1/claims")
    assert {c["uid"]: c["devices"][0]["mig"] is not None for c in listed["claims"]} == {
        "static": True, "made": True, "whole": False}
