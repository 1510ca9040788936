"""The simulation routes for sharing: MPS clients through ``POST /v1/sim/processes``, the
daemons and per-GPU compute mode and time slice in ``GET /v1/sim``, tool faults through
``POST /v1/sim/faults`` (in-process app over a simulated L40S node)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.gpu.backend import Backend
from agent.gpu.sim.node import SimulatedNode
from agent.settings import resolve
from agent.wiring import build_node

ADMIN = {"Authorization": "Bearer o1"}
Client = TestClient[Any, Any]


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any,
              reap_daemons: Callable[[int], None]) -> AsyncIterator[tuple[Client, SimulatedNode]]:
    settings = resolve({"simulate": "l40s", "state_dir": str(tmp_path / "state")}, env={})
    node = SimulatedNode("l40s", settings.state_dir, settings.proc_root)
    (tmp_path / "tokens").write_text("ops:o1:admin\n")
    (tmp_path / "tokens").chmod(0o600)
    agent_node = build_node(settings, Backend(nvml=node.nvml, name="simulated:l40s", sim=node,
                                              sys_root=node.sys_root))
    await agent_node.session.initialise()
    await agent_node.inventory.load()
    agent_node.readiness.reconciled = True
    agent_node.readiness.set(None)
    app: web.Application = build_app(AgentContext(node=agent_node,
                                                  tokens=TokenStore.load(tmp_path / "tokens")))
    client: Client = await aiohttp_client(app)
    yield client, node
    await client.close()
    node.close()


async def start_daemon(node: SimulatedNode, root: Path, gpu: str, *commands: str) -> Path:
    """A daemon on one GPU, started and configured with the node's own tool; its pipe dir."""
    return await asyncio.to_thread(_start_daemon, node, root, gpu, *commands)


def _start_daemon(node: SimulatedNode, root: Path, gpu: str, *commands: str) -> Path:
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(root / "log"), "CUDA_VISIBLE_DEVICES": gpu}
    tool = str(node.tools_dir / "nvidia-cuda-mps-control")
    assert subprocess.run([tool, "-d"], env=env, timeout=30, check=False).returncode == 0
    if commands:
        assert subprocess.run([tool], env=env, input="".join(f"{c}\n" for c in commands),
                              text=True, timeout=30, check=False).returncode == 0
    return root / "pipe"


async def state(client: Client) -> dict[str, Any]:
    reply = await client.get("/v1/sim")
    assert reply.status == 200
    body: dict[str, Any] = await reply.json()
    return body


@pytest.mark.parametrize(("mib", "uid", "refused"), [
    (4096, 0, False),
    (10240, 0, False),
    (10241, 0, True),
    (1024, 7, False),
])
async def test_an_mps_client_is_held_to_the_pinned_limit(
        api: tuple[Client, SimulatedNode], tmp_path: Path, mib: int, uid: int,
        refused: bool) -> None:
    """A client above the daemon's pinned limit is refused (422 naming used_memory_mib, an
    out-of-memory message); one within it is created as that daemon's client."""
    client, node = api
    gpu = node.gpu_uuids()[0]
    pipe = await start_daemon(node, tmp_path / "mps", gpu,
                              f"set_default_device_pinned_mem_limit {gpu} 10G",
                              "set_default_active_thread_percentage 25")
    reply = await client.post("/v1/sim/processes", headers=ADMIN, json={
        "device": "0", "used_memory_mib": mib, "mps_pipe_directory": str(pipe), "uid": uid})
    assert reply.status == (422 if refused else 201)
    if refused:
        problem = await reply.json(content_type="application/problem+json")
        assert [e["field"] for e in problem["errors"]] == ["used_memory_mib"]
        assert "out of memory" in problem["detail"]
        assert (await state(client))["processes"] == []
        return
    body = await reply.json()
    assert body["mps"]["uid"] == uid
    assert body["mps"]["pinned_limit_mib"] == 10240
    assert body["mps"]["active_thread_percentage"] == 25
    [daemon] = (await state(client))["mps_daemons"]
    [server] = daemon["servers"]
    assert server["clients"] == [{"pid": body["pid"], "device": gpu, "used_memory_mib": mib}]


async def test_delete_disconnects_the_client(api: tuple[Client, SimulatedNode],
                                             tmp_path: Path) -> None:
    """DELETE of a client's pid ends it: the daemon's server has no clients left, NVML
    reports none."""
    client, node = api
    gpu = node.gpu_uuids()[1]
    pipe = await start_daemon(node, tmp_path / "mps", gpu)
    created = await (await client.post("/v1/sim/processes", headers=ADMIN, json={
        "device": gpu, "used_memory_mib": 100, "mps_pipe_directory": str(pipe)})).json()
    assert (await client.delete(f"/v1/sim/processes/{created['pid']}",
                                headers=ADMIN)).status == 204
    [daemon] = (await state(client))["mps_daemons"]
    assert [s["clients"] for s in daemon["servers"]] == [[]]
    handle = node.nvml.nvmlDeviceGetHandleByUUID(gpu)
    assert node.nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle) == []


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"uid": -1}, 422, "uid"),
    ({"mps_pipe_directory": ""}, 422, "mps_pipe_directory"),
    ({"mps_pipe_directory": "/nonexistent/pipe"}, 422, "mps_pipe_directory"),
])
async def test_bad_mps_requests_name_the_field(api: tuple[Client, SimulatedNode],
                                               body: dict[str, Any], status: int,
                                               field: str) -> None:
    """A bad uid, or a pipe directory where no daemon answers, is a 4xx naming the field."""
    client, _ = api
    reply = await client.post("/v1/sim/processes", headers=ADMIN,
                              json={"device": "0", **body})
    assert reply.status == status
    problem = await reply.json(content_type="application/problem+json")
    assert field in [e["field"] for e in problem["errors"]]


async def test_a_second_user_would_wait(api: tuple[Client, SimulatedNode],
                                        tmp_path: Path) -> None:
    """While one UID's server has clients, another UID's client is 409 saying it would wait."""
    client, node = api
    pipe = await start_daemon(node, tmp_path / "mps", node.gpu_uuids()[0])
    first = {"device": "0", "used_memory_mib": 10, "mps_pipe_directory": str(pipe), "uid": 1}
    assert (await client.post("/v1/sim/processes", headers=ADMIN, json=first)).status == 201
    reply = await client.post("/v1/sim/processes", headers=ADMIN, json={**first, "uid": 2})
    assert reply.status == 409
    assert "would wait" in (await reply.json(content_type="application/problem+json"))["detail"]


async def test_state_shows_compute_mode_and_timeslice(api: tuple[Client, SimulatedNode]) -> None:
    """``GET /v1/sim`` gives each GPU's compute mode and time slice as nvidia-smi set them."""
    client, node = api
    smi = str(node.tools_dir / "nvidia-smi")
    for args in (["-i", "1", "-c", "EXCLUSIVE_PROCESS"],
                 ["compute-policy", "-i", "2", "--set-timeslice", "2"]):
        proc = await asyncio.create_subprocess_exec(smi, *args)
        assert await proc.wait() == 0
    gpus = (await state(client))["gpus"]
    assert [(g["compute_mode"], g["timeslice"]) for g in gpus] == [
        ("DEFAULT", 0), ("EXCLUSIVE_PROCESS", 0), ("DEFAULT", 2), ("DEFAULT", 0)]


@pytest.mark.parametrize(("fault", "status"), [
    ({"function": "nvidia-smi", "error": "Insufficient Permissions"}, 201),
    ({"function": "nvidia-cuda-mps-control", "error": "cannot start", "skip": 1, "times": 2},
     201),
    ({"function": "nvidia-settings", "error": "x"}, 422),
])
async def test_tool_faults_through_the_api(api: tuple[Client, SimulatedNode],
                                           fault: dict[str, Any], status: int) -> None:
    """The driver tools take faults like NVML functions; other names are refused."""
    client, _ = api
    reply = await client.post("/v1/sim/faults", headers=ADMIN, json=fault)
    assert reply.status == status
    if status == 201:
        [listed] = (await state(client))["faults"]
        assert (listed["function"], listed["error"]) == (fault["function"], fault["error"])
