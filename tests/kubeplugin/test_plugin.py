"""The kubelet plugin as kubelet sees it: registration, NodePrepareResources and
NodeUnprepareResources over gRPC on the plugin's Unix sockets, against a real agent process.

The fixtures are in conftest.py: ``kubelet`` is the plugin running in this loop with an
in-memory ClaimReader, ``agent`` the agent process (``--simulate dgx-h100``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from agent.kubeplugin.proto import registration_pb2
from tests.agent_process import AgentProcess
from tests.kubeplugin.conftest import (
    DRIVER,
    NODE,
    Agent,
    Hold,
    Kubelet,
    close_kubelet,
    open_kubelet,
    result,
    settings_for,
    start_with_plugin_token,
    write_private,
)
from tests.waiting import until, wait_for


def set_mig(agent: AgentProcess, gpu: str, body: dict[str, Any]) -> None:
    """PUT /v1/gpus/{gpu}/mig and wait for the change to finish."""
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", body)
    assert reply.status in (200, 202), reply.body
    if reply.status == 202:
        def ended() -> dict[str, Any] | None:
            body: dict[str, Any] = agent.request("GET", reply.headers["location"],
                                                 token=None).body
            return body if body["terminal"] else None
        body = wait_for(ended, "the MIG change to finish")
        assert body["state"] == "succeeded", body


def published(agent: AgentProcess) -> list[str]:
    """Every device name of the agent's ResourceSlices (what the scheduler allocates)."""
    body = agent.request("GET", "/v1/resourceslices").body
    return [d["name"] for item in body["items"] for d in item["spec"].get("devices", [])]


# Blocking file checks, out of the async tests' bodies (they take microseconds).
def is_socket(path: Path) -> bool:
    return path.is_socket()


def exists(path: Path) -> bool:
    return path.exists()


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def agent_claim(agent: AgentProcess, uid: str) -> Any:
    return agent.request("GET", f"/v1/claims/{uid}")


def devices_of(answer: Any) -> list[tuple[list[str], str, str, list[str]]]:
    return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
            for d in answer.devices]


async def metrics(kubelet: Kubelet) -> str:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{kubelet.health_url}/metrics") as response:
        return await response.text()


async def readyz(kubelet: Kubelet) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{kubelet.health_url}/readyz") as response:
        return response.status, await response.json()


@pytest.fixture
async def l40s(short_dir: Path) -> AsyncIterator[tuple[Kubelet, Agent]]:
    """The plugin against a 4x L40S agent (no MIG): a full-GPU prepare's only NVML call is
    its GPU's minor-number read, which nothing else repeats after start, so a latency set on
    it slows exactly the prepares."""
    agent = start_with_plugin_token(short_dir / "state", preset="l40s")
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    yield kubelet, agent
    await close_kubelet(kubelet)
    agent.process.stop(signal.SIGKILL)


# -- registration --------------------------------------------------------------------------


async def test_registration_names_the_driver_its_endpoint_and_both_versions(
        kubelet: Kubelet, short_dir: Path) -> None:
    """GetInfo on <registry-dir>/<driver>-reg.sock answers type DRAPlugin, the driver, the DRA
    socket under <plugins-dir>/<driver>/, and v1 then v1beta1, then the optional health
    service, v1 then v1alpha1."""
    info = await kubelet.registration.GetInfo(registration_pb2.InfoRequest(), timeout=1)
    assert kubelet.plugin.servers.registration_socket == short_dir / "registry" / \
        f"{DRIVER}-reg.sock"
    assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
        "DRAPlugin", DRIVER, str(short_dir / "plugins" / DRIVER / "dra.sock"),
        ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
         "v1alpha1.DRAResourceHealth"])
    assert is_socket(Path(info.endpoint))


async def test_readiness_follows_registration_agent_api_server_and_publisher(
        kubelet: Kubelet) -> None:
    """/readyz is 503 naming each failing check (not registered, kubelet refused, API server
    down, slices out of sync) and 200 once all hold; /healthz is 200 throughout."""
    status, body = await readyz(kubelet)
    assert status == 503 and "GetInfo" in body["checks"]["registered"]
    await kubelet.registration.NotifyRegistrationStatus(registration_pb2.RegistrationStatus(
        plugin_registered=False, error="no common version"), timeout=5)
    status, body = await readyz(kubelet)
    assert status == 503 and "no common version" in body["reason"]
    await kubelet.registration.NotifyRegistrationStatus(
        registration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
    status, body = await readyz(kubelet)
    assert (status, body["status"]) == (200, "ready"), body
    assert "gpu_agent_plugin_registered 1.0" in await metrics(kubelet)

    kubelet.claims.down = True
    kubelet.publisher.in_sync, kubelet.publisher.reason = False, "fields dropped: taints"
    status, body = await readyz(kubelet)
    assert status == 503
    assert "API server down" in body["checks"]["api_server"]
    assert "fields dropped: taints" in body["checks"]["slices"]
    assert body["checks"]["agent"] == "ok" and body["checks"]["registered"] == "ok"
    async with aiohttp.ClientSession() as session, \
            session.get(f"{kubelet.health_url}/healthz") as response:
        assert response.status == 200
    assert kubelet.publisher.runs == 1


async def test_readiness_names_an_unreachable_agent(short_dir: Path, agent: Agent) -> None:
    """An agent that stopped answering makes /readyz 503 with the agent check saying so."""
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    try:
        agent.process.stop(signal.SIGKILL)
        status, body = await readyz(kubelet)
        assert status == 503 and "agent unreachable" in body["checks"]["agent"]
    finally:
        await close_kubelet(kubelet)


# -- prepare ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
async def test_prepare_of_a_full_gpu_and_a_mig_device_returns_the_agents_cdi_ids(
        kubelet: Kubelet, agent: Agent, version: str) -> None:
    """Each claim's answer lists its device with the request name, this node's pool, the
    ResourceSlice device name and the CDI IDs the agent wrote, on either DRA version."""
    set_mig(agent.process, "5", {"profiles": ["3g.40gb"]})
    mig = next(n for n in published(agent.process) if n.startswith("gpu-5-mig-3g40gb"))
    full = kubelet.claims.add("full", [result("gpu-2", "trainer")])
    sliced = kubelet.claims.add("sliced", [result(mig, "small")])
    answer = await kubelet.prepare(full, sliced, version=version)
    assert set(answer) == {full.uid, sliced.uid}
    for claim, device, request in ((full, "gpu-2", "trainer"), (sliced, mig, "small")):
        assert answer[claim.uid].error == ""
        recorded = agent_claim(agent.process, claim.uid).body
        assert recorded["metadata"]["name"] == claim.name
        cdi = recorded["devices"][0]["cdi_devices"]
        assert devices_of(answer[claim.uid]) == [([request], NODE, device, cdi)]
        assert cdi == [f"k8s.gpu.nodeagent.dev/claim={claim.uid}-{device}"]
        spec = read_json(Path(recorded["cdi_spec"]))
        assert f"{claim.uid}-{device}" in [d["name"] for d in spec["devices"]]


async def test_a_partitionable_mig_device_is_made_at_its_placement_and_destroyed(
        short_dir: Path) -> None:
    """With --dynamic-mig, a claim allocated a MIG placement the agent published as consuming
    counters is prepared as an on-demand slice exactly there, and unprepared by destroying it."""
    agent = start_with_plugin_token(short_dir / "state", extra=["--dynamic-mig"])
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    try:
        set_mig(agent.process, "3", {"mig_enabled": True})  # MIG on, no instances yet
        body = agent.process.request("GET", "/v1/resourceslices").body
        placement = next(d["name"] for item in body["items"]
                         for d in item["spec"].get("devices", [])
                         if d["name"].startswith("gpu-3-mig-1g10gb-") and
                         d["name"].endswith("-2") and d.get("consumesCounters"))
        claim = kubelet.claims.add("dynamic", [result(placement, "slice")])
        answer = await kubelet.prepare(claim)
        assert answer[claim.uid].error == "", answer[claim.uid].error
        assert devices_of(answer[claim.uid])[0][:3] == (["slice"], NODE, placement)
        made = agent.process.request("GET", "/v1/gpus/3").body["mig_devices"]
        assert [(d["profile"], d["placement"]["start"]) for d in made] == [("1g.10gb", 2)]
        assert await kubelet.unprepare(claim) == {claim.uid: ""}
        assert agent.process.request("GET", "/v1/gpus/3").body["mig_devices"] == []
    finally:
        await close_kubelet(kubelet)
        agent.process.stop(signal.SIGKILL)


async def test_prepare_is_idempotent(kubelet: Kubelet, agent: Agent) -> None:
    """A repeated prepare (kubelet's retry) answers the same devices and holds one claim;
    each is timed."""
    claim = kubelet.claims.add("again", [result("gpu-4")])
    first = await kubelet.prepare(claim)
    second = await kubelet.prepare(claim)
    assert first[claim.uid].error == "" and devices_of(first[claim.uid]) == devices_of(
        second[claim.uid])
    holders = [c["uid"] for c in agent.process.request("GET", "/v1/claims").body["claims"]]
    assert holders == [claim.uid]
    assert "gpu_agent_plugin_prepare_seconds_count 2.0" in await metrics(kubelet)


async def test_a_multi_driver_claim_keeps_only_this_drivers_devices_of_this_node(
        kubelet: Kubelet, agent: Agent) -> None:
    """Results of another driver, or of this driver in another pool, are neither sent to the
    agent nor answered; admin access reaches the agent as non-exclusive (the device another
    claim holds is still given)."""
    holder = kubelet.claims.add("holder", [result("gpu-1")])
    assert (await kubelet.prepare(holder))[holder.uid].error == ""
    claim = kubelet.claims.add("mixed", [
        result("nic-0", "net", driver="net.example.com"),
        result("gpu-0", "remote", pool="node-b"),
        result("gpu-3", "gpu"),
        result("gpu-1", "monitor", admin=True),
    ])
    answer = await kubelet.prepare(claim)
    assert answer[claim.uid].error == ""
    assert [(r, d) for r, _, d, _ in devices_of(answer[claim.uid])] == [
        (["gpu"], "gpu-3"), (["monitor"], "gpu-1")]
    recorded = agent_claim(agent.process, claim.uid).body
    assert sorted(d["device_name"] for d in recorded["devices"]) == ["gpu-1", "gpu-3"]


async def test_one_bad_claim_fails_alone(kubelet: Kubelet, agent: Agent) -> None:
    """In one call, every bad claim gets its own error naming why, and the good one is
    prepared: no top-level error."""
    claims = kubelet.claims
    good = claims.add("good", [result("gpu-6")])
    cases = {
        "recreated": (claims.add("recreated", [result("gpu-7")]), "deleted and created again"),
        "missing": (claims.add("missing", [result("gpu-7")]), "not found"),
        "unallocated": (claims.add("unallocated", None), "not allocated"),
        "foreign": (claims.add("foreign", [result("nic-0", driver="net.example.com")]),
                    "no device of driver gpu.nodeagent.dev"),
        "unknown-device": (claims.add("unknown-device", [result("gpu-99")]), "HTTP 422"),
    }
    claims.objects[("default", "recreated")]["metadata"]["uid"] = "someone-else"
    del claims.objects[("default", "missing")]
    answer = await kubelet.prepare(good, *(c for c, _ in cases.values()))
    assert answer[good.uid].error == "" and devices_of(answer[good.uid])[0][2] == "gpu-6"
    for name, (claim, expected) in cases.items():
        error = answer[claim.uid].error
        assert expected in error and claim.uid in error, (name, error)
        assert list(answer[claim.uid].devices) == []
    text = await metrics(kubelet)
    for reason in ("uid-mismatch", "claim-not-found", "not-allocated", "no-devices",
                   "agent-refused"):
        assert f'gpu_agent_plugin_prepare_errors_total{{reason="{reason}"}} 1.0' in text


async def test_a_not_ready_agent_is_a_retryable_per_claim_error(short_dir: Path) -> None:
    """While the agent answers 503 not-ready (NVML not up yet), each claim's error says the
    agent is not ready and when to retry, never that it is unreachable."""
    faults = [{"function": "nvmlInit", "error": "NVML_ERROR_DRIVER_NOT_LOADED", "times": 1000}]
    agent = start_with_plugin_token(short_dir / "state", wait_ready=False,
                                    env={"GPU_AGENT_SIM_FAULTS": json.dumps(faults)})
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    try:
        claim = kubelet.claims.add("early", [result("gpu-0")])
        answer = await kubelet.prepare(claim)
        error = answer[claim.uid].error
        assert "not ready" in error and "retry in" in error and claim.uid in error, error
        assert "unreachable" not in error
        assert 'gpu_agent_plugin_prepare_errors_total{reason="agent-not-ready"} 1.0' in \
            await metrics(kubelet)
    finally:
        await close_kubelet(kubelet)
        agent.process.stop(signal.SIGKILL)


async def test_an_absent_agent_is_unreachable_per_claim(short_dir: Path, agent: Agent) -> None:
    """With no agent on the socket, each claim's error says the agent is unreachable."""
    kubelet = await open_kubelet(settings_for(short_dir, agent))
    try:
        agent.process.stop(signal.SIGKILL)
        claim = kubelet.claims.add("nobody", [result("gpu-0")])
        error = (await kubelet.prepare(claim))[claim.uid].error
        assert "unreachable" in error and str(agent.process.socket_path) in error, error
    finally:
        await close_kubelet(kubelet)


# -- unprepare and ordering ---------------------------------------------------------------


async def test_unprepare_of_unknown_claims_is_success_for_each(kubelet: Kubelet) -> None:
    """Unpreparing claims the agent never prepared answers every claim, without an error."""
    claims = [kubelet.claims.add(f"never-{i}", [result("gpu-0")]) for i in range(3)]
    assert await kubelet.unprepare(*claims) == {c.uid: "" for c in claims}


async def test_unprepare_releases_the_device(kubelet: Kubelet, agent: Agent) -> None:
    """After an unprepare the agent holds nothing for the claim and its CDI spec is gone; the
    unprepare is timed."""
    claim = kubelet.claims.add("release", [result("gpu-3")])
    answer = await kubelet.prepare(claim)
    assert answer[claim.uid].error == ""
    spec = Path(agent_claim(agent.process, claim.uid).body["cdi_spec"])
    assert await kubelet.unprepare(claim) == {claim.uid: ""}
    assert agent_claim(agent.process, claim.uid).status == 404
    assert not exists(spec)
    assert "gpu_agent_plugin_unprepare_seconds_count 1.0" in await metrics(kubelet)


async def test_a_late_prepare_is_refused_and_a_new_one_succeeds(kubelet: Kubelet,
                                                                 agent: Agent) -> None:
    """A prepare kubelet sent before an unprepare that reaches the agent after it is refused
    (no resurrection); a prepare sent after the unprepare, same allocation, succeeds."""
    claim = kubelet.claims.add("shared", [result("gpu-5")])
    assert (await kubelet.prepare(claim))[claim.uid].error == ""
    hold = kubelet.claims.held["shared"] = Hold()
    late = asyncio.create_task(kubelet.prepare(claim))  # stamped now, held before the agent
    await hold.reached.wait()
    assert await kubelet.unprepare(claim) == {claim.uid: ""}
    hold.release.set()
    error = (await late)[claim.uid].error
    assert "claim-unprepared" in error, error
    assert agent_claim(agent.process, claim.uid).status == 404
    del kubelet.claims.held["shared"]
    again = await kubelet.prepare(claim)
    assert again[claim.uid].error == "" and devices_of(again[claim.uid])[0][2] == "gpu-5"
    assert agent_claim(agent.process, claim.uid).body["state"] == "prepare_completed"


async def test_a_prepare_past_kubelets_deadline_still_finishes(
        l40s: tuple[Kubelet, Agent]) -> None:
    """When kubelet's deadline passes mid-prepare the agent call still completes, so the retry
    gets the prepared devices at once."""
    kubelet, agent = l40s
    agent.process.request("PUT", "/v1/sim/latency", {"nvmlDeviceGetMinorNumber": 1.5})
    claim = kubelet.claims.add("slow", [result("gpu-1")])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await kubelet.prepare(claim, deadline_s=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Nothing retries yet: the abandoned call itself finishes and is counted.
    async def counted() -> bool:
        return 'gpu_agent_plugin_finished_after_deadline_total{call="prepare"} 1.0' in \
            await metrics(kubelet)
    await until(counted, "the abandoned prepare to finish")
    recorded = await asyncio.to_thread(agent_claim, agent.process, claim.uid)
    assert recorded.status == 200 and recorded.body["state"] == "prepare_completed"
    reads = await asyncio.to_thread(_minor_reads, agent.process)
    retry = await kubelet.prepare(claim, deadline_s=5)
    assert retry[claim.uid].error == "" and devices_of(retry[claim.uid])[0][2] == "gpu-1"
    # The agent's idempotent answer: not one more NVML read of the slowed call.
    assert await asyncio.to_thread(_minor_reads, agent.process) == reads


def _minor_reads(agent: AgentProcess) -> int:
    reply = agent.request("GET", "/v1/sim")
    assert reply.status == 200, reply.body
    return int(reply.body["calls"].get("nvmlDeviceGetMinorNumber", 0))


async def test_claims_on_different_gpus_are_prepared_in_parallel(
        l40s: tuple[Kubelet, Agent]) -> None:
    """With each GPU's NVML read on the prepare path slowed to L, two claims on two GPUs (in
    one call, and in two concurrent calls) take about L together, not 2L: no node-wide
    serialisation in the plugin."""
    kubelet, agent = l40s
    latency = 1.0
    agent.process.request("PUT", "/v1/sim/latency", {"nvmlDeviceGetMinorNumber": latency})
    one = kubelet.claims.add("alone", [result("gpu-0")])
    started = time.monotonic()
    assert (await kubelet.prepare(one))[one.uid].error == ""
    single = time.monotonic() - started
    assert single >= latency  # the latency is on the prepare's path
    a, b = kubelet.claims.add("a", [result("gpu-1")]), kubelet.claims.add("b", [result("gpu-2")])
    started = time.monotonic()
    answer = await kubelet.prepare(a, b)
    together = time.monotonic() - started
    assert answer[a.uid].error == answer[b.uid].error == ""
    assert await kubelet.unprepare(a, b) == {a.uid: "", b.uid: ""}
    c, d = kubelet.claims.add("c", [result("gpu-1")]), kubelet.claims.add("d", [result("gpu-3")])
    started = time.monotonic()
    both = await asyncio.gather(kubelet.prepare(c), kubelet.prepare(d))
    separate = time.monotonic() - started
    assert both[0][c.uid].error == both[1][d.uid].error == ""
    assert together < single + latency * 0.6, (single, together)
    assert separate < single + latency * 0.6, (single, separate)


# -- credentials ---------------------------------------------------------------------------


async def test_a_rotated_token_is_used_without_restart(kubelet: Kubelet, agent: Agent) -> None:
    """Rewriting the token file switches the token on the next call: a wrong token is a
    per-claim 401, the right one prepares."""
    write_private(agent.token_file, "plugin:not-the-token\n")
    claim = kubelet.claims.add("rotated", [result("gpu-7")])
    error = (await kubelet.prepare(claim))[claim.uid].error
    assert "HTTP 401" in error, error
    write_private(agent.token_file, agent.plugin_token)
    assert (await kubelet.prepare(claim))[claim.uid].error == ""
