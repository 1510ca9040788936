"""``-o table|wide|json|yaml`` on every listing verb (issue 24), through the CLI's own entry
point against an agent served in process: json and yaml are the agent's answer as it is, the
table fits 120 columns, ``-o wide`` shows every cell in full."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.cli import options
from agent.cli.main import main
from tests.service_node import ServiceNode, open_services

TOKEN = "t0ken-for-the-cli"
#: Longer than any table column may be: the table cuts it, ``-o wide`` shows it.
LONG_POD = "inference-" + "x" * 150


@dataclass
class Served:
    client: TestClient[Any, Any]
    node: ServiceNode
    argv: list[str]
    """The connection flags that reach it."""

    async def answer(self, path: str) -> Any:
        reply = await self.client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status == 200, await reply.text()
        return await reply.json()

    async def cli(self, *argv: str, capsys: pytest.CaptureFixture[str]) -> str:
        """What ``gpu-agent ARGV`` prints (exit 0 asserted); it runs in a thread while the
        loop serves its requests."""
        code = await asyncio.to_thread(main, [*argv, *self.argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out


@pytest.fixture
async def served(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Served]:
    """A DGX H100 with a MIG layout on GPU 0 (so a transition) and a claim with a long pod
    name on GPU 5."""
    node = await open_services(tmp_path / "node")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops:{TOKEN}\n")
    tokens.chmod(0o600)
    client: TestClient[Any, Any] = await aiohttp_client(build_app(AgentContext(
        node=node.node, tokens=TokenStore.load(tokens))))
    served = Served(client, node, ["--url", str(client.make_url("")).rstrip("/"),
                                   "--token-file", str(tokens)])
    await node.mig_to(0, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    reply = await client.put("/v1/claims/claim-long-pod", json={
        "devices": [{"kind": "gpu", "device": "5"}],
        "metadata": {"namespace": "ml", "pod": LONG_POD}},
        headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 200, await reply.text()
    yield served
    await node.close()


async def _mig_docs(served: Served) -> list[Any]:
    gpus = (await served.answer("/v1/gpus"))["gpus"]
    return [await served.answer(f"/v1/gpus/{g['index']}/mig") for g in gpus if g["mig_capable"]]


async def _transition(served: Served) -> str:
    return str((await served.answer("/v1/transitions"))["transitions"][0]["id"])


@pytest.mark.parametrize(("argv", "path"), [
    (["mig", "show", "0"], "/v1/gpus/0/mig"),
    (["mig", "export"], "/v1/mig/export"),
    (["transitions"], "/v1/transitions"),
    (["claims"], "/v1/claims"),
    (["claims", "claim-long-pod"], "/v1/claims/claim-long-pod"),
    (["claims", "show", "claim-long-pod"], "/v1/claims/claim-long-pod"),
    (["cdi", "list"], "/v1/cdi"),
    (["topo"], "/v1/topology"),
    (["topo", "slices", "--kubernetes", "1.36"], "/v1/resourceslices?kubernetes=1.36"),
    (["admin", "checkpoint"], "/v1/admin/claims-checkpoint"),
])
async def test_json_and_yaml_are_the_agents_answer_as_it_is(
        served: Served, argv: list[str], path: str, capsys: pytest.CaptureFixture[str]) -> None:
    answer = await served.answer(path)
    assert json.loads(await served.cli(*argv, "-o", "json", capsys=capsys)) == answer
    assert json.loads(await served.cli(*argv, "--json", capsys=capsys)) == answer
    assert yaml.safe_load(await served.cli(*argv, "-o", "yaml", capsys=capsys)) == answer


async def test_mig_show_of_every_gpu_is_the_list_of_their_answers(
        served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    docs = await _mig_docs(served)
    assert json.loads(await served.cli("mig", "show", "-o", "json", capsys=capsys)) == docs
    assert yaml.safe_load(await served.cli("mig", "-o", "yaml", "show", capsys=capsys)) == docs


async def test_transitions_id_is_the_agents_answer(served: Served,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    tid = await _transition(served)
    answer = await served.answer(f"/v1/transitions/{tid}")
    assert json.loads(await served.cli("transitions", tid, "-o", "json", capsys=capsys)) == answer
    text = await served.cli("transitions", tid, capsys=capsys)
    assert text.startswith(f"transition {tid} on GPU 0: succeeded")


@pytest.mark.parametrize("argv", [
    ["mig", "show"], ["mig", "show", "0"], ["transitions"], ["claims"],
    ["claims", "claim-long-pod"], ["cdi", "list"], ["topo"], ["gpus"], ["node"],
])
async def test_tables_fit_120_columns_and_wide_cuts_nothing(
        served: Served, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    table = await served.cli(*argv, capsys=capsys)
    wide = await served.cli(*argv, "-o", "wide", capsys=capsys)
    assert table.strip() and wide.strip()
    assert max(len(line) for line in table.splitlines()) <= options.TABLE_WIDTH, table
    assert "..." not in wide


async def test_the_claims_listing_names_the_pod_in_full_only_when_wide(
        served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    table = await served.cli("claims", capsys=capsys)
    wide = await served.cli("claims", "-o", "wide", capsys=capsys)
    assert "claim-long-pod" in table and "ml/inference-" in table and LONG_POD not in table
    assert f"ml/{LONG_POD}" in wide


async def test_an_empty_listing_says_so(served: Served,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    reply = await served.client.delete("/v1/claims/claim-long-pod",
                                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 204
    assert await served.cli("claims", capsys=capsys) == "no claims prepared on this node\n"
    assert json.loads(await served.cli("claims", "-o", "json", capsys=capsys)) == {"claims": []}
