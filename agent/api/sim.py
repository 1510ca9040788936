"""Simulation controls (``/v1/sim/*``), registered only when the agent runs with --simulate."""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from agent.api.body import parse_body
from agent.api.context import AGENT
from agent.api.models import (
    SimFabricRequest,
    SimFault,
    SimFaultRequest,
    SimGpuRequest,
    SimLatencyRequest,
    SimProcess,
    SimProcessRequest,
    SimState,
    SimXidRequest,
)
from agent.api.routing import json_response
from agent.device_names import ascii_integer
from agent.errors import InvalidRequest, NotFound
from agent.gpu.sim.node import SimulatedNode
from agent.ledger.keys import resolve


def _sim(request: web.Request) -> SimulatedNode:
    sim = request.app[AGENT].node.sim
    if sim is None:  # the routes exist only with --simulate
        raise NotFound("this agent is not simulated")
    return sim


def _uuid(request: web.Request, ref: str, field: str) -> str:
    """A device as the simulator names it (its UUID), however the caller named it: like the
    rest of the API, a GPU index, ``<gpu>:<mig>`` or a ResourceSlice device name work too."""
    if ref.startswith(("GPU-", "MIG-")):
        return ref  # the simulator answers an unknown UUID itself
    try:
        gpu, device = resolve(ref, request.app[AGENT].node.inventory.gpus)
    except InvalidRequest:
        raise NotFound(f"{field}: no GPU or MIG device {ref[:96]!r} on this node (a UUID, a "
                       "GPU index, <gpu>:<mig> or a ResourceSlice device name)",
                       gpu=ref[:96]) from None
    return device.uuid if device is not None else gpu.uuid


def _sim_state(request: web.Request) -> SimState:
    return SimState.model_validate(_sim(request).describe())


async def sim_state(request: web.Request) -> web.Response:
    return json_response(await asyncio.to_thread(_sim_state, request))


async def add_process(request: web.Request) -> web.Response:
    body = await parse_body(request, SimProcessRequest)
    sim = _sim(request)
    device = _uuid(request, body.device, "device")
    record = await asyncio.to_thread(functools.partial(
        sim.add_process, device, body.pid, body.used_memory_mib,
        mps_pipe_directory=body.mps_pipe_directory, uid=body.uid))
    return json_response(SimProcess.model_validate(record), status=201)


async def remove_process(request: web.Request) -> web.Response:
    raw = request.match_info["pid"]
    pid = ascii_integer(raw, digits=7)
    if pid is None:
        raise InvalidRequest(f"pid: {raw[:40]!r} is not a process id",
                             [{"field": "pid", "reason": "not a positive integer"}])
    await asyncio.to_thread(_sim(request).remove_process, pid)
    return web.Response(status=204)


async def add_fault(request: web.Request) -> web.Response:
    body = await parse_body(request, SimFaultRequest)
    gpu = None if body.gpu is None else _uuid(request, body.gpu, "gpu")
    record = await asyncio.to_thread(_sim(request).add_fault, body.function, body.error,
                                     gpu, body.skip, body.times)
    return json_response(SimFault.model_validate(record), status=201)


async def clear_faults(request: web.Request) -> web.Response:
    await asyncio.to_thread(_sim(request).clear_faults)
    return web.Response(status=204)


async def set_latency(request: web.Request) -> web.Response:
    body = await parse_body(request, SimLatencyRequest)
    await asyncio.to_thread(_sim(request).set_latency, body.root)
    return json_response(await asyncio.to_thread(_sim_state, request))


async def inject_xid(request: web.Request) -> web.Response:
    body = await parse_body(request, SimXidRequest)
    await asyncio.to_thread(_sim(request).inject_xid, _uuid(request, body.gpu, "gpu"),
                            body.xid, body.recovery_action)
    return web.Response(status=202)


async def set_fabric(request: web.Request) -> web.Response:
    body = await parse_body(request, SimFabricRequest)
    await asyncio.to_thread(_sim(request).set_fabric, _uuid(request, body.gpu, "gpu"),
                            body.condition, body.status)
    return web.Response(status=204)


async def reset_gpu(request: web.Request) -> web.Response:
    """A reset brings a lost GPU back and makes an XID-marked one trustworthy again: both
    marks are cleared (``gpu.health_cleared``)."""
    body = await parse_body(request, SimGpuRequest)
    ctx = request.app[AGENT]
    uuid = _uuid(request, body.gpu, "gpu")
    await asyncio.to_thread(_sim(request).reset_gpu, uuid)
    ctx.node.session.clear_lost(uuid)
    ctx.node.health.clear(uuid, why="GPU reset")
    await _after_reload(request, reset=frozenset({uuid}))
    return web.Response(status=204)


async def _after_reload(request: web.Request, *, reset: frozenset[str] = frozenset()) -> None:
    """What the agent does at start-up after a real driver reload or reset, done now: the
    agent keeps running through the simulator's, so it re-reads the inventory and re-applies
    the MIG geometry the reload emptied (``mig.reapply``) instead of finding it changed
    behind its back at the next drift check."""
    node = request.app[AGENT].node
    await node.inventory.refresh()
    await node.mig.reconcile(reset=reset)


async def reload_driver(request: web.Request) -> web.Response:
    ctx = request.app[AGENT]
    await asyncio.to_thread(_sim(request).reload_driver)
    for gpu in ctx.node.inventory.gpus:
        ctx.node.session.clear_lost(gpu.uuid)
        ctx.node.health.clear(gpu.uuid, why="driver reloaded")
    await _after_reload(request)
    return web.Response(status=204)
