"""``gpu-agent gpus`` on each simulated preset's inventory, served in process (issue 24): the
table fits 120 columns, ``-o wide`` has every column in full, ``gpus N`` shows one GPU."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.cli import options
from agent.cli.main import parser
from agent.cli.tables import gpu_detail, gpu_table
from agent.gpu.backend import Backend
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.sim.presets import preset_names
from agent.settings import resolve
from agent.wiring import build_node

Serve = Callable[[str], Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def serve(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Serve]:
    sims: list[SimulatedNode] = []

    async def start(preset: str) -> TestClient[Any, Any]:
        settings = resolve({"simulate": preset, "state_dir": str(tmp_path / preset)}, env={})
        sim = SimulatedNode(preset, settings.state_dir, settings.proc_root)
        sims.append(sim)
        node = build_node(settings, Backend(nvml=sim.nvml, name=f"simulated:{preset}",
                                            sim=sim, sys_root=sim.sys_root))
        await node.session.initialise()
        await node.inventory.load()
        await node.ledger.register(node.inventory.gpus)
        client: TestClient[Any, Any] = await aiohttp_client(build_app(AgentContext(
            node=node, tokens=TokenStore.empty())))
        return client

    yield start
    for sim in sims:
        sim.close()


@pytest.mark.parametrize("preset", preset_names())
async def test_the_gpus_table_fits_120_columns_and_wide_has_every_column(
        serve: Serve, preset: str) -> None:
    client = await serve(preset)
    gpus = (await (await client.get("/v1/gpus")).json())["gpus"]
    text = gpu_table(gpus, options.TABLE_WIDTH)
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert len(text.splitlines()) >= len(gpus) + 1
    wide = gpu_table(gpus, None)
    for gpu in gpus:
        assert gpu["uuid"] in wide and gpu["pci_bus_id"] in wide and gpu["name"] in wide
    one = await (await client.get(f"/v1/gpus/{gpus[-1]['uuid']}")).json()
    detail = gpu_detail(one, options.TABLE_WIDTH)
    assert max(len(line) for line in detail.splitlines()) <= 120, detail
    assert one["uuid"] in detail and gpus[0]["uuid"] not in detail.replace(one["uuid"], "")


def test_a_long_cell_is_cut_to_fit() -> None:
    gpu = {"index": 0, "name": "NVIDIA " + "X" * 200, "uuid": "GPU-1", "pci_bus_id": "0:1",
           "memory_total_mib": 81559, "numa_node": 0,
           "mig_mode": {"current": False, "pending": False},
           "mig_devices": [], "health": {"healthy": False, "reasons": ["r" * 300]},
           "availability": {"available": True, "reasons": [], "holders": []}, "holds": [],
           "shares": None, "taints": []}
    text = gpu_table([gpu], 120)
    assert all(len(line) <= 120 for line in text.splitlines()), text
    assert "..." in text
    assert "r" * 300 in gpu_table([gpu], None)


@pytest.mark.parametrize(("argv", "gpu", "fmt"), [
    (["gpus"], None, "table"), (["gpus", "0"], "0", "table"),
    (["gpus", "GPU-1", "-o", "wide"], "GPU-1", "wide"), (["gpus", "-o", "json"], None, "json"),
    (["gpus", "--json"], None, "json"), (["node", "-o", "yaml"], None, "yaml"),
])
def test_gpus_takes_one_gpu_and_an_output_format(argv: list[str], gpu: str | None,
                                                 fmt: str) -> None:
    args = parser().parse_args(argv)
    assert getattr(args, "gpu", None) == gpu
    assert options.output_format(args) == fmt
