"""Issue 23, taints instead of withdrawal, against a real agent process: an XID taints the
GPU's device in /v1/resourceslices (published still) within the 2 s republish goal and a
reset clears it; an application XID is informational; a lost GPU keeps its taint, with the
same timeAdded, across an agent restart; /v1/gpus, the events and the taint gauge say the
same."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.integration.owner_steps import gpu_request, prepare, problem
from tests.waiting import wait_for

URL = "/v1/resourceslices?kubernetes=1.37"
DRIVER = "gpu.nodeagent.dev"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    running = start_agent(tmp_path / "state")
    yield running
    running.stop(signal.SIGKILL)


def device(body: Any, name: str) -> dict[str, Any] | None:
    """The device ``name`` of the slices, or None when it is not published."""
    return next((d for s in body["items"] for d in s["spec"].get("devices") or []
                 if d["name"] == name), None)


def taints_of(body: Any, name: str) -> list[dict[str, Any]] | None:
    """The published device's taints ([] untainted), None when it is not published."""
    found = device(body, name)
    return None if found is None else list(found.get("taints") or [])


def long_poll(agent: AgentProcess, url: str, done: Callable[[Any], bool],
              within_s: float) -> tuple[Any, float]:
    """Long-poll ``url`` from its current ETag until ``done(body)``; (body or None, seconds)."""
    first = agent.request("GET", url)
    started = time.monotonic()
    if done(first.body):
        return first.body, 0.0
    etag = first.headers["etag"]
    while (left := within_s - (time.monotonic() - started)) > 0:
        reply = agent.request("GET", f"{url}&wait_s={left:.2f}",
                              headers={"If-None-Match": etag})
        if reply.status == 200:
            etag = reply.headers["etag"]
            if done(reply.body):
                return reply.body, time.monotonic() - started
    return None, time.monotonic() - started


def held(agent: AgentProcess, url: str) -> tuple[Any, str]:
    """The current body and its ETag."""
    reply = agent.request("GET", url)
    return reply.body, reply.headers["etag"]


def wait_tainted(agent: AgentProcess, name: str, key: str, within_s: float = 30) -> Any:
    body, _ = long_poll(agent, URL, lambda b: any(
        t["key"] == key for t in taints_of(b, name) or []), within_s)
    assert body is not None, f"{name} never tainted {key}"
    return body


def sample(agent: AgentProcess, name: str, **labels: str) -> float | None:
    """One series of the agent's /metrics, None when absent."""
    text = agent.request("GET", "/metrics", token=None).body
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(" ", 1)
            got = ",".join(sorted(series[len(name) + 1:-1].split(",")))
            if got == want:
                return float(value)
    return None


def events(agent: AgentProcess, kind: str) -> list[dict[str, Any]]:
    return [e for e in agent.request("GET", "/v1/events").body["events"] if e["kind"] == kind]


def test_xid_48_taints_the_device_within_2s_and_a_reset_clears_it(agent: AgentProcess) -> None:
    """Done-when: XID 48 on GPU 3 -> gpu-3 stays in its slice with the taint
    gpu.nodeagent.dev/xid=48:NoSchedule within 2 s of the XID (the issue's republish goal),
    to a publisher already long-polling; /v1/gpus, the gauge and an event say so; a reset
    clears it, as soon."""
    uuid = agent.request("GET", "/v1/gpus/3").body["uuid"]
    assert taints_of(agent.request("GET", URL).body, "gpu-3") == []
    _, etag = held(agent, URL)
    waiting = agent.send("GET", f"{URL}&wait_s=20", headers={"If-None-Match": etag})
    started = time.monotonic()
    assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 48}).status == 202
    reply = waiting.reply()
    assert reply.status == 200
    body = reply.body if taints_of(reply.body, "gpu-3") else long_poll(
        agent, URL, lambda b: bool(taints_of(b, "gpu-3")), 10)[0]
    took = time.monotonic() - started
    assert body is not None
    (taint,) = taints_of(body, "gpu-3") or [None]
    assert taint is not None and set(taint) == {"key", "value", "effect", "timeAdded"}
    assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/xid", "48",
                                                              "NoSchedule")
    assert time.strptime(taint["timeAdded"], "%Y-%m-%dT%H:%M:%SZ")
    assert took < 2.0, f"tainted {took:.2f} s after the XID (goal 2 s)"

    gpu = agent.request("GET", "/v1/gpus/3").body
    assert gpu["taints"] == [{"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule",
                              "time_added": taint["timeAdded"],
                              "reason": "XID 48: Double Bit ECC Error"}]
    assert gpu["availability"]["state"] == "unavailable"
    assert gpu["availability"]["reasons"] == ["XID 48: Double Bit ECC Error"]
    labels = {"gpu": "3", "UUID": uuid, "GPU_I_ID": "", "key": f"{DRIVER}/xid", "value": "48",
              "effect": "NoSchedule"}
    wait_for(lambda: sample(agent, "gpu_agent_gpu_taint_added_timestamp_seconds", **labels),
             "the taint's gauge")
    added = wait_for(lambda: events(agent, "gpu.taint_added"), "a gpu.taint_added event")
    assert [e["details"]["key"] for e in added] == [f"{DRIVER}/xid"]

    _, etag = held(agent, URL)
    waiting = agent.send("GET", f"{URL}&wait_s=20", headers={"If-None-Match": etag})
    reset = time.monotonic()
    assert agent.request("POST", "/v1/sim/reset", {"gpu": uuid}).status == 204
    reply = waiting.reply()
    body = reply.body if reply.status == 200 and taints_of(reply.body, "gpu-3") == [] else \
        long_poll(agent, URL, lambda b: taints_of(b, "gpu-3") == [], 10)[0]
    took = time.monotonic() - reset
    assert body is not None, "the reset did not clear the taint"
    assert took < 2.0, f"untainted {took:.2f} s after the reset (goal 2 s)"
    assert agent.request("GET", "/v1/gpus/3").body["taints"] == []
    wait_for(lambda: sample(agent, "gpu_agent_gpu_taint_added_timestamp_seconds",
                            **labels) is None, "the taint's gauge gone")
    removed = wait_for(lambda: events(agent, "gpu.taint_removed"), "gpu.taint_removed event")
    assert [e["details"]["key"] for e in removed] == [f"{DRIVER}/xid"]


@pytest.mark.parametrize("xid", [31, 94])
def test_xid_31_is_an_informational_taint_and_the_gpu_stays_available(
        agent: AgentProcess, xid: int) -> None:
    """Done-when: an application XID (31) adds only an informational taint (effect None,
    left out for 1.34, which has no None): the GPU stays available and a claim takes it. So
    does XID 94 (contained ECC error), by the driver's recovery action (none), not the XID
    table."""
    uuid = agent.request("GET", "/v1/gpus/2").body["uuid"]
    assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": xid}).status == 202
    body = wait_tainted(agent, "gpu-2", f"{DRIVER}/xid")
    assert [(t["value"], t["effect"]) for t in taints_of(body, "gpu-2") or []] == [
        (str(xid), "None")]
    old = agent.request("GET", "/v1/resourceslices?kubernetes=1.34").body
    assert taints_of(old, "gpu-2") == []
    gpu = agent.request("GET", "/v1/gpus/2").body
    assert [t["effect"] for t in gpu["taints"]] == ["None"]
    assert gpu["availability"]["state"] == "available" and gpu["health"]["healthy"]
    assert prepare(agent, f"c-{xid}", gpu_request("2")).status == 200


def _restart(agent: AgentProcess) -> AgentProcess:
    agent.stop(signal.SIGTERM)
    return start_agent(agent.state_dir)


def test_a_lost_gpu_keeps_its_taint_and_time_across_an_agent_restart(tmp_path: Path) -> None:
    """Done-when: XID 79 takes GPU 5 off the bus; its device is published tainted
    gpu-lost (and xid=79); after an agent restart, with NVML naming the GPU by no UUID, gpu-5
    is still published with the same taints and the same timeAdded."""
    agent = start_agent(tmp_path / "state")
    try:
        uuid = agent.request("GET", "/v1/gpus/5").body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202
        body = wait_tainted(agent, "gpu-5", f"{DRIVER}/gpu-lost")
        before = {(t["key"], t.get("value"), t["effect"], t["timeAdded"])
                  for t in taints_of(body, "gpu-5") or []}
        assert {k for k, *_ in before} == {f"{DRIVER}/gpu-lost", f"{DRIVER}/xid"}
        agent = _restart(agent)
        after = agent.request("GET", URL).body
        assert {(t["key"], t.get("value"), t["effect"], t["timeAdded"])
                for t in taints_of(after, "gpu-5") or []} == before
        published = device(after, "gpu-5")
        assert published is not None and published["attributes"]["uuid"]["string"] == uuid
        gpu = agent.request("GET", "/v1/gpus/5").body
        assert gpu["availability"]["state"] == "unavailable"
        assert f"{DRIVER}/gpu-lost" in {t["key"] for t in gpu["taints"]}
    finally:
        agent.stop(signal.SIGKILL)


def test_a_reset_gpu_does_not_get_its_taint_back_after_a_restart(tmp_path: Path) -> None:
    """A GPU reset after XID 79 is untainted, and stays so across an agent restart."""
    agent = start_agent(tmp_path / "state")
    try:
        uuid = agent.request("GET", "/v1/gpus/5").body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202
        wait_tainted(agent, "gpu-5", f"{DRIVER}/gpu-lost")
        assert agent.request("POST", "/v1/sim/reset", {"gpu": uuid}).status == 204
        body, _ = long_poll(agent, URL, lambda b: taints_of(b, "gpu-5") == [], 30)
        assert body is not None
        agent = _restart(agent)
        assert taints_of(agent.request("GET", URL).body, "gpu-5") == []
        assert agent.request("GET", "/v1/gpus/5").body["taints"] == []
    finally:
        agent.stop(signal.SIGKILL)


def test_with_no_execute_taints_a_lost_gpu_is_tainted_no_execute(tmp_path: Path) -> None:
    """--no-execute-taints: XID 79 (reboot class) and the lost GPU taint NoExecute; XID 48
    stays NoSchedule."""
    agent = start_agent(tmp_path / "state", extra=["--no-execute-taints"])
    try:
        lost, other = (agent.request("GET", f"/v1/gpus/{i}").body["uuid"] for i in (5, 6))
        assert agent.request("POST", "/v1/sim/xid", {"gpu": lost, "xid": 79}).status == 202
        assert agent.request("POST", "/v1/sim/xid", {"gpu": other, "xid": 48}).status == 202
        body = wait_tainted(agent, "gpu-5", f"{DRIVER}/gpu-lost")
        body = wait_tainted(agent, "gpu-6", f"{DRIVER}/xid")
        assert {(t["key"], t["effect"]) for t in taints_of(body, "gpu-5") or []} == {
            (f"{DRIVER}/gpu-lost", "NoExecute"), (f"{DRIVER}/xid", "NoExecute")}
        assert [t["effect"] for t in taints_of(body, "gpu-6") or []] == ["NoSchedule"]
    finally:
        agent.stop(signal.SIGKILL)


def test_drain_and_undrain_over_rest_and_the_cli(agent: AgentProcess) -> None:
    """An operator's drain publishes GPU 1 tainted drain=<reason>:NoSchedule, refuses new
    claims on it and leaves the claim already on it prepared; bad bodies are 422 naming the
    field and change nothing; undrain lifts it; undraining an undrained GPU is 409."""
    assert prepare(agent, "c-held", gpu_request("1")).status == 200
    for bad, field in (({}, "reason"), ({"reason": ""}, "reason"),
                       ({"reason": "x" * 257}, "reason"), ({"reason": 5}, "reason"),
                       ({"reason": "ok", "until": 3}, "until")):
        reply = agent.request("POST", "/v1/admin/gpus/1/drain", bad)
        assert reply.status == 422, (bad, reply.body)
        assert reply.content_type == "application/problem+json"
        assert field in {e["field"] for e in reply.body["errors"]}, reply.body
    assert agent.request("GET", "/v1/gpus/1").body["taints"] == []
    assert agent.request("POST", "/v1/admin/gpus/99/drain", {"reason": "x"}).status == 404

    reply = agent.request("POST", "/v1/admin/gpus/1/drain", {"reason": "fan swap, ticket 42"})
    assert reply.status == 200, reply.body
    assert reply.body["taint"]["key"] == f"{DRIVER}/drain"
    assert reply.body["taint"]["value"] == "fan-swap-ticket-42"
    assert agent.request("POST", "/v1/admin/gpus/1/drain",
                         {"reason": "fan swap, ticket 42"}).status == 200  # the same: a no-op
    assert agent.request("POST", "/v1/admin/gpus/1/drain", {"reason": "other"}).status == 409
    body = wait_tainted(agent, "gpu-1", f"{DRIVER}/drain")
    assert [(t["value"], t["effect"]) for t in taints_of(body, "gpu-1") or []] == [
        ("fan-swap-ticket-42", "NoSchedule")]
    assert agent.request("GET", "/v1/claims/c-held").body["state"] == "prepare_completed"
    agent.request("DELETE", "/v1/claims/c-held")
    refused = prepare(agent, "c-new", gpu_request("1"))
    assert refused.status == 409 and problem(refused) == "device-unavailable", refused.body
    assert "fan swap" in refused.body["detail"]
    gpu = agent.request("GET", "/v1/gpus/1").body
    assert gpu["drained"] == "fan swap, ticket 42" and gpu["health"]["healthy"]

    assert agent.request("DELETE", "/v1/admin/gpus/1/drain").body["was"] == \
        "fan swap, ticket 42"
    again = agent.request("DELETE", "/v1/admin/gpus/1/drain")
    assert again.status == 409 and again.content_type == "application/problem+json"
    assert long_poll(agent, URL, lambda b: taints_of(b, "gpu-1") == [], 30)[0] is not None
    assert prepare(agent, "c-new", gpu_request("1")).status == 200


def test_a_drain_by_the_cli_survives_a_restart_and_undrain_lifts_it(tmp_path: Path) -> None:
    """``gpu-agent admin drain 4 --reason R`` drains durably (still tainted after an agent
    restart, same timeAdded); ``gpu-agent admin undrain 4`` lifts it."""
    agent = start_agent(tmp_path / "state")
    try:
        done = _cli(agent, "admin", "drain", "4", "--reason", "bad fan")
        assert done.returncode == 0, done.stderr
        assert '"fan"' not in done.stdout and "bad-fan" in done.stdout
        before = taints_of(wait_tainted(agent, "gpu-4", f"{DRIVER}/drain"), "gpu-4")
        agent = _restart(agent)
        assert taints_of(agent.request("GET", URL).body, "gpu-4") == before
        missing = _cli(agent, "admin", "drain", "4")
        assert missing.returncode != 0 and "--reason" in missing.stderr
        done = _cli(agent, "admin", "undrain", "4")
        assert done.returncode == 0, done.stderr
        assert '"was": "bad fan"' in done.stdout
        assert agent.request("GET", "/v1/gpus/4").body["drained"] is None
        again = _cli(agent, "admin", "undrain", "4")
        assert again.returncode != 0 and "not drained" in again.stderr
    finally:
        agent.stop(signal.SIGKILL)


def _cli(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args, "--url", agent.url,
                           "--token-file", str(agent.state_dir / "tokens")],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_gpu_whose_xid_events_cannot_be_registered_is_tainted_unmonitored(
        tmp_path: Path) -> None:
    """NVML refuses event registration on GPU 2 (armed before the agent starts): its device
    gets the informational ``unmonitored`` taint, every other GPU none, and GPU 2 stays
    available (nobody can know it is faulty, so nothing keeps claims off it)."""
    faults = '[{"function": "nvmlDeviceRegisterEvents", "error": "NOT_SUPPORTED", "gpu": "2"}]'
    agent = start_agent(tmp_path / "state", env={"GPU_AGENT_SIM_FAULTS": faults})
    try:
        def tainted() -> Any:
            body = agent.request("GET", URL).body
            return body if taints_of(body, "gpu-2") else None

        body = wait_for(tainted, "GPU 2 tainted unmonitored")
        assert [(t["key"], t.get("value"), t["effect"]) for t in taints_of(body, "gpu-2")
                or []] == [(f"{DRIVER}/unmonitored", None, "None")]
        assert all(taints_of(body, f"gpu-{i}") == [] for i in range(8) if i != 2)
        gpu = agent.request("GET", "/v1/gpus/2").body
        assert gpu["availability"]["available"] is True
        assert [t["key"] for t in gpu["taints"]] == [f"{DRIVER}/unmonitored"]
    finally:
        agent.stop(signal.SIGKILL)
