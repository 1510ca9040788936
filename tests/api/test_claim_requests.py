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
        ({"kind": "gpu", "request": "gpu", "device": "0"}, 422, "devices.0.request"),
    "both spellings are refused even when they disagree":
        ({"kind": "gpu", "request": "slice", "device": "0"}, 422, "devices.0.request"),
    "neither spelling is a missing kind": ({"device": "0"}, 422, "devices.0.kind"),
    "a kind that is neither gpu nor slice": ({"kind": "mig", "device": "0"}, 422,
                                             "devices.0.kind"),
    "the old spelling is checked as kind is": ({"request": "mig", "device": "0"}, 422,
                                               "devices.0.kind"),
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
