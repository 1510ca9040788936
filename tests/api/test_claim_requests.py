"""A claim's device entries through the API (issue 15, claim requests): the device kind is
``kind`` (``request``, its old spelling, is still read alone and refused beside it), and a
slice that cannot be made says why and what to do: no GPU with MIG on, or no room on those
that have it, each its own problem type."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.api.problems import PROBLEM_BASE
from tests.service_node import ServiceNode, open_services
from tests.waiting import until

TOKEN = "t1"


@dataclass
class Api:
    client: TestClient[Any, Any]
    node: ServiceNode

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        reply = await self.client.request(method, path, json=body,
                                          headers={"Authorization": f"Bearer {TOKEN}"})
        text = await reply.text()
        return reply.status, json.loads(text) if text else None

    async def prepare(self, uid: str, *devices: dict[str, Any]) -> tuple[int, Any]:
        return await self.call("PUT", f"/v1/claims/{uid}", {"devices": list(devices)})


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Api]:
    node = await open_services(tmp_path / "node")
    (tmp_path / "tokens").write_text(f"admin:{TOKEN}:admin\n")
    (tmp_path / "tokens").chmod(0o600)
    ctx = AgentContext(node=node.node, tokens=TokenStore.load(tmp_path / "tokens"))
    client: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
    try:
        yield Api(client, node)
    finally:
        await node.close()


# -- the device kind's name --------------------------------------------------------------------

#: Each entry: the device entry sent, then the status and (for a 422) the field it names.
SPELLINGS: dict[str, tuple[dict[str, Any], int, str | None]] = {
    "kind names an existing GPU": ({"kind": "gpu", "device": "0"}, 200, None),
    "the old spelling 'request' alone still works": ({"request": "gpu", "device": "0"}, 200,
                                                     None),
    "the old spelling works for slices too": ({"request": "slice", "profile": "1g.10gb",
                                               "gpu": "2"}, 200, None),
    "both spellings at once are refused, naming the old one":
        ({"kind": "gpu", "request": "gpu", "device": "0"}, 422, "devices[0].request"),
    "both spellings are refused even when they disagree":
        ({"kind": "gpu", "request": "slice", "device": "0"}, 422, "devices[0].request"),
    "neither spelling is a missing kind": ({"device": "0"}, 422, "devices[0].kind"),
    "a kind that is neither gpu nor slice": ({"kind": "mig", "device": "0"}, 422,
                                             "devices[0].kind"),
    "the old spelling is checked as kind is": ({"request": "mig", "device": "0"}, 422,
                                               "devices[0].kind"),
}


@pytest.mark.parametrize(("entry", "status", "field"), SPELLINGS.values(), ids=SPELLINGS.keys())
async def test_the_device_kind_is_kind_and_request_is_its_old_spelling(
        api: Api, entry: dict[str, Any], status: int, field: str | None) -> None:
    """``kind`` or (alone) ``request`` says what a device entry asks for; both at once, or
    neither, is a 422 naming the field; nothing is prepared by a refused entry."""
    await api.node.mig_to(2, [])
    got, body = await api.prepare("c1", entry)
    assert got == status, body
    if status == 422:
        assert body["type"] == PROBLEM_BASE + "invalid-request"
        assert field in [e["field"] for e in body["errors"]], body
        assert (await api.call("GET", "/v1/claims"))[1]["claims"] == []
    else:
        assert body["devices"][0]["request"] == entry.get("kind", entry.get("request"))


async def test_openapi_documents_kind_and_the_deprecated_spelling(api: Api) -> None:
    """The OpenAPI document requires ``kind`` and lists ``request`` as deprecated, saying
    it is the old spelling of ``kind``."""
    _, doc = await api.call("GET", "/openapi.json")
    schema = doc["components"]["schemas"]["DeviceRequestIn"]
    assert "kind" in schema["required"] and "request" not in schema.get("required", [])
    assert schema["properties"]["request"]["deprecated"] is True
    assert "'kind'" in schema["properties"]["request"]["description"]
    assert "request" in schema["description"] and "kind" in schema["description"]


# -- why a slice cannot be made ----------------------------------------------------------------

class SliceCase(NamedTuple):
    mig: dict[int, list[str]]
    """The GPUs given MIG first (index -> profiles; [] is MIG on and empty)."""
    entry: dict[str, Any]
    kind: str
    """The problem type answered."""
    fields: dict[str, Any]
    """Problem fields as answered (None: absent)."""
    phrases: list[str]
    """What the detail says."""


SLICES: dict[str, SliceCase] = {
    "no GPU has MIG on": SliceCase(
        {}, {"kind": "slice", "profile": "1g.10gb"}, "mig-not-enabled",
        {"profile": "1g.10gb", "mig_off": list(range(8))},
        ["no GPU has MIG enabled", "PUT /v1/gpus/{gpu}/mig", "request a whole GPU"]),
    "the pinned GPU has MIG off while another has it on": SliceCase(
        {1: []}, {"kind": "slice", "profile": "1g.10gb", "gpu": "3"}, "mig-not-enabled",
        {"mig_off": [3]}, ["GPU 3 has MIG off", "PUT /v1/gpus/3/mig", "whole GPU"]),
    "no room for a 7g on the one MIG GPU while seven have MIG off": SliceCase(
        {0: ["1g.10gb"]}, {"kind": "slice", "profile": "7g.80gb"}, "no-slice-room",
        {"profile": "7g.80gb", "gpus": [0], "mig_off": [1, 2, 3, 4, 5, 6, 7]},
        ["no MIG-enabled GPU (0) has room for 7g.80gb", "7 GPUs (1, 2, 3, 4, 5, 6, 7) have "
         "MIG off", "enable MIG on one (PUT /v1/gpus/{gpu}/mig)", "release a slice"]),
    "no room on a pinned full GPU": SliceCase(
        {4: ["7g.80gb"]}, {"kind": "slice", "profile": "1g.10gb", "gpu": "4"},
        "no-slice-room", {"gpus": [4], "mig_off": None},
        ["GPU 4 has no room for 1g.10gb", "release a slice"]),
    "no room at the start asked for": SliceCase(
        {5: ["3g.40gb"]}, {"kind": "slice", "profile": "1g.10gb", "gpu": "5",
                           "placement": {"start": 4}},
        "no-slice-room", {"start": 4, "gpus": [5]}, ["at memory slice 4", "another start"]),
}


@pytest.mark.parametrize("case", SLICES.values(), ids=SLICES.keys())
async def test_a_slice_that_cannot_be_made_says_why_and_what_to_do(api: Api,
                                                                    case: SliceCase) -> None:
    """No MIG-enabled GPU to put a slice on is 409 ``mig-not-enabled``; MIG-enabled GPUs
    without room for it are 409 ``no-slice-room``; each detail says what to do, and nothing
    is prepared."""
    for index, profiles in case.mig.items():
        await api.node.mig_to(index, profiles)
    status, body = await api.prepare("s1", case.entry)
    assert (status, body["type"]) == (409, PROBLEM_BASE + case.kind), body
    assert {k: body.get(k) for k in case.fields} == case.fields, body
    for phrase in case.phrases:
        assert phrase in body["detail"], body["detail"]
    assert (await api.call("GET", "/v1/claims"))[1]["claims"] == []


async def test_a_slice_fits_once_mig_is_enabled_as_the_refusal_says(api: Api) -> None:
    """Doing what ``mig-not-enabled`` says (enable MIG on a GPU) lets the same slice in."""
    entry = {"kind": "slice", "profile": "1g.10gb"}
    assert (await api.prepare("s1", entry))[0] == 409
    status, change = await api.call("PUT", "/v1/gpus/6/mig", {"profiles": []})
    assert status == 202, change
    async def ended() -> Any:
        _, transition = await api.call("GET", f"/v1/transitions/{change['transition']['id']}")
        return transition if transition["terminal"] else None
    transition = await until(ended, "the transition enabling MIG to end")
    assert transition["state"] == "succeeded", transition
    status, body = await api.prepare("s1", entry)
    assert status == 200, body
    assert body["devices"][0]["parent_uuid"] == (await api.node.gpu(6)).uuid


# -- devices the node cannot prepare -----------------------------------------------------------

#: With ``device_names: resourceslice`` (the kubelet plugin's): the entries sent, then the
#: fields the 422 names. GPU 2 has MIG on, with one 1g.10gb.
NOT_SLICE_NAMES: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
    "an index beside a slice name": ([{"kind": "gpu", "device": "gpu-0"},
                                      {"kind": "gpu", "device": "1"}], ["devices[1].device"]),
    "a UUID": ([{"kind": "gpu", "device": "GPU-{uuid}"}], ["devices[0].device"]),
    "a MIG device by <gpu>:<mig>": ([{"kind": "gpu", "device": "2:0"}], ["devices[0].device"]),
    "a slice by profile": ([{"kind": "slice", "profile": "1g.10gb", "gpu": "2"}],
                           ["devices[0].device"]),
    "a slice by a whole GPU's name": ([{"kind": "slice", "device": "gpu-2"}],
                                      ["devices[0].device"]),
    "every bad entry at once": ([{"kind": "gpu", "device": "0"},
                                 {"kind": "gpu", "device": "gpu-1"},
                                 {"kind": "gpu", "device": "gpu-01"}],
                                ["devices[0].device", "devices[2].device"]),
}


async def _nothing_held(api: Api) -> None:
    assert (await api.call("GET", "/v1/claims"))[1]["claims"] == []
    for gpu in range(3):
        assert (await api.call("GET", f"/v1/gpus/{gpu}"))[1]["holds"] == [], gpu


@pytest.mark.parametrize(("entries", "fields"), NOT_SLICE_NAMES.values(),
                         ids=NOT_SLICE_NAMES.keys())
async def test_resourceslice_names_refuse_any_other_name_before_holding_anything(
        api: Api, entries: list[dict[str, Any]], fields: list[str]) -> None:
    """With ``device_names: resourceslice`` every entry must name its device as the
    ResourceSlices do, so the answer names it as the allocation did: any other name of a
    device (which the default ``any`` accepts) is a 422 naming each such entry, and nothing
    is held; the same claim with slice names is prepared under those names."""
    await api.node.mig_to(2, ["1g.10gb"])
    uuid = (await api.call("GET", "/v1/gpus/0"))[1]["uuid"]
    sent = [{**e, "device": e["device"].replace("GPU-{uuid}", uuid)} if "device" in e else e
            for e in entries]
    status, body = await api.call("PUT", "/v1/claims/c1",
                                  {"devices": sent, "device_names": "resourceslice"})
    assert status == 422, body
    assert [e["field"] for e in body["errors"]] == fields, body
    assert all(f in body["detail"] for f in fields), body
    await _nothing_held(api)
    _, slices = await api.call("GET", "/v1/resourceslices")
    mig = next(d["name"] for item in slices["items"] for d in item["spec"]["devices"]
               if d["name"].startswith("gpu-2-mig-1g10gb-"))
    status, body = await api.call("PUT", "/v1/claims/c1", {"devices": [
        {"kind": "gpu", "device": "gpu-0"}, {"kind": "gpu", "device": mig}],
        "device_names": "resourceslice"})
    assert status == 200, body
    assert [d["device_name"] for d in body["devices"]] == ["gpu-0", mig]


#: Entries of which some name nothing on this node (any naming): the fields the 422 names.
NOT_ON_THIS_NODE: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
    "a GPU the node does not have beside one it has": (
        [{"kind": "gpu", "device": "gpu-0"}, {"kind": "gpu", "device": "gpu-99"}],
        ["devices[1].device"]),
    "every unknown entry is named": (
        [{"kind": "gpu", "device": "nope"}, {"kind": "gpu", "device": "1"},
         {"kind": "gpu", "device": "GPU-00000000-0000-0000-0000-00000000dead"}],
        ["devices[0].device", "devices[2].device"]),
    "a MIG device that does not exist": (
        [{"kind": "gpu", "device": "gpu-1"}, {"kind": "gpu", "device": "gpu-3-mig-1g10gb-19-3"}],
        ["devices[1].device"]),
    "a slice on a GPU the node does not have, after a whole GPU": (
        [{"kind": "gpu", "device": "gpu-0"},
         {"kind": "slice", "device": "gpu-9-mig-1g10gb-19-0"}], ["devices[1].device"]),
    "a slice of a profile the GPU does not have": (
        [{"kind": "gpu", "device": "gpu-0"}, {"kind": "slice", "profile": "9g.900gb"}],
        ["devices[1].profile"]),
}


@pytest.mark.parametrize(("entries", "fields"), NOT_ON_THIS_NODE.values(),
                         ids=NOT_ON_THIS_NODE.keys())
async def test_devices_the_node_does_not_have_are_named_before_anything_is_held(
        api: Api, entries: list[dict[str, Any]], fields: list[str]) -> None:
    """A claim naming a device the node does not have beside ones it has is a 422 naming
    every such entry, checked with the whole claim before any device is reserved."""
    await api.node.mig_to(2, ["1g.10gb"])
    status, body = await api.prepare("c1", *entries)
    assert status == 422, body
    assert [e["field"] for e in body["errors"]] == fields, body
    await _nothing_held(api)


async def test_device_names_is_any_or_resourceslice(api: Api) -> None:
    """Another ``device_names`` is a 422 naming the field; the default takes any name."""
    status, body = await api.call("PUT", "/v1/claims/c1", {
        "devices": [{"kind": "gpu", "device": "0"}], "device_names": "uuid"})
    assert status == 422 and body["errors"][0]["field"] == "device_names", body
    status, body = await api.prepare("c1", {"kind": "gpu", "device": "0"})
    assert status == 200 and body["devices"][0]["device_name"] == "gpu-0", body
