"""A 422 names each refused field with one spelling, whichever code refused it: list positions
in brackets, names after dots (``devices[0].sharing.strategy``). pydantic's validation of a
body and the services' own checks agree, so a client can match the field either produced."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import all_routes, build_app
from agent.api.auth import TokenStore
from agent.api.body import field_path
from agent.api.context import AgentContext
from tests.service_node import open_services

TOKEN = "t1"


@pytest.mark.parametrize(("loc", "path"), [
    ((), "(body)"),
    (("count",), "count"),
    (("devices", 0), "devices[0]"),
    (("devices", 0, "device"), "devices[0].device"),
    (("devices", 12, "sharing", "mpsConfig", "defaultActiveThreadPercentage"),
     "devices[12].sharing.mpsConfig.defaultActiveThreadPercentage"),
    (("matrix", 1, 2), "matrix[1][2]"),
    ((0, "kind"), "[0].kind"),
    (("mig-configs", "all-1g", 0, "devices", 1), "mig-configs.all-1g[0].devices[1]"),
])
def test_a_location_is_spelled_with_brackets_for_positions(loc: tuple[int | str, ...],
                                                           path: str) -> None:
    """Each pydantic location becomes one path: positions in brackets, names after dots."""
    assert field_path(loc) == path


@pytest.fixture
async def client(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[TestClient[Any, Any]]:
    """The API over a simulated DGX H100, ready, with an admin token."""
    node = await open_services(tmp_path / "node")
    (tmp_path / "tokens").write_text(f"admin:{TOKEN}:admin\n")
    (tmp_path / "tokens").chmod(0o600)
    ctx = AgentContext(node=node.node, tokens=TokenStore.load(tmp_path / "tokens"))
    made: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
    try:
        yield made
    finally:
        await node.close()


def _dev(**extra: Any) -> dict[str, Any]:
    return {"kind": "gpu", "device": "0", **extra}


_MPS = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}

#: Each case: method, path, body, and the field path its 422 must name. Refused by pydantic
#: (types, bounds, unknown keys) or by a service (a device the node lacks, a share too big):
#: the same spelling either way, at the top level, in a list, and in lists of lists.
CASES: dict[str, tuple[str, str, Any, str]] = {
    "claim: a device of the wrong type (validation)":
        ("PUT", "/v1/claims/c", {"devices": [{"kind": "gpu", "device": 3}]},
         "devices[0].device"),
    "claim: the second entry's missing kind (validation)":
        ("PUT", "/v1/claims/c", {"devices": [_dev(), {"device": "1"}]}, "devices[1].kind"),
    "claim: a nested sharing config (validation)":
        ("PUT", "/v1/claims/c", {"devices": [_dev(), _dev(device="1", sharing=_MPS)]},
         "devices[1].sharing.mpsConfig.defaultActiveThreadPercentage"),
    "claim: a whole entry refused (validation)":
        ("PUT", "/v1/claims/c", {"devices": [{"kind": "slice", "profile": "1g.10gb",
                                              "share_id": "s"}]}, "devices[0]"),
    "claim: a device the node lacks (service)":
        ("PUT", "/v1/claims/c", {"devices": [_dev(), _dev(device="nope")]},
         "devices[1].device"),
    "claim: a slice on a GPU the node lacks (service)":
        ("PUT", "/v1/claims/c", {"devices": [{"kind": "slice", "profile": "1g.10gb",
                                              "gpu": "99"}]}, "devices[0].gpu"),
    "mig: an instance's placement (validation)":
        ("PUT", "/v1/gpus/2/mig?dry_run=true",
         {"instances": [{"profile": "1g.10gb", "placement": {"start": 0, "size": 1}},
                        {"profile": "3g.40gb", "placement": {"start": "4", "size": 4}}]},
         "instances[1].placement.start"),
    "mig: a profile of the wrong type (validation)":
        ("PUT", "/v1/gpus/2/mig?dry_run=true", {"profiles": ["1g.10gb", 7]}, "profiles[1]"),
    "mig apply: the second entry of a label (service, within the config)":
        ("POST", "/v1/mig/apply?dry_run=true",
         {"config": {"version": "v1", "mig-configs": {"x": [
             {"devices": [2], "mig-enabled": True, "mig-devices": {}},
             {"devices": [3], "mig-enabled": True, "mig-devices": {"1g.10gb": -1}}]}},
          "label": "x"}, "mig-configs.x[1].mig-devices"),
    "mig apply: a config neither an object nor text (validation of a union)":
        ("POST", "/v1/mig/apply?dry_run=true", {"config": 7, "label": "x"}, "config"),
    "topology: a GPU neither an index nor a UUID (validation of a union)":
        ("POST", "/v1/topology/select", {"count": 2, "must_include": [0, [1]]},
         "must_include[1]"),
    "topology: a candidate GPU the node lacks (service)":
        ("POST", "/v1/topology/select", {"count": 1, "candidates": [0, 42]}, "candidates"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_every_422_spells_list_positions_in_brackets(client: TestClient[Any, Any],
                                                           case: str) -> None:
    """The 422 names the field as ``a[0].b``; no field of any 422 has a bare ``.0``."""
    method, path, body, field = CASES[case]
    reply = await client.request(method, path, data=json.dumps(body),
                                 headers={"Authorization": f"Bearer {TOKEN}",
                                          "Content-Type": "application/json"})
    problem = json.loads(await reply.text())
    assert reply.status == 422, problem
    fields = [e["field"] for e in problem["errors"]]
    assert field in fields, problem
    assert field in problem["detail"], problem
    assert [f for f in fields if any(p.isdigit() for p in f.split("."))] == [], problem


def _unions_without_one_error(schema: Any, where: str) -> Iterator[str]:
    """Where ``schema`` (a pydantic core schema, walked whole) has a union that would report
    one error per member."""
    if isinstance(schema, dict):
        if schema.get("type") == "union" and "custom_error_type" not in schema:
            yield where
        for key, value in schema.items():
            yield from _unions_without_one_error(value, f"{where}/{key}")
    elif isinstance(schema, list):
        for n, value in enumerate(schema):
            yield from _unions_without_one_error(value, f"{where}[{n}]")


def test_every_union_in_a_request_body_is_refused_as_one_field() -> None:
    """No request model has a union pydantic would refuse member by member (fields such as
    ``must_include[1].int``): each is marked :class:`agent.api.models.OneOf`."""
    bodies = {r.body for r in all_routes(simulated=True) if r.body is not None}
    assert len(bodies) >= 8
    found = [spot for body in sorted(bodies, key=lambda b: b.__name__)
             for spot in _unions_without_one_error(body.__pydantic_core_schema__, body.__name__)]
    assert found == [], "mark these unions with OneOf(...)"
