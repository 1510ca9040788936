"""Live MIG geometry through a real agent process: the API, configs, and crash recovery."""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.mig.parted_export import standard_configs
from tests.agent_process import AgentProcess, start_agent
from tests.integration.owner_steps import wait_transition
from tests.mig.catalogs import H100_80GB
from tests.waiting import wait_for

BALANCED = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
MUTATING = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy",
            "nvmlGpuInstanceDestroy")


def put_mig(agent: AgentProcess, gpu: str, body: dict[str, Any], query: str = "") -> Any:
    return agent.request("PUT", f"/v1/gpus/{gpu}/mig{query}", body)


def layout(agent: AgentProcess, gpu: str = "0") -> list[str]:
    geometry = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    if not geometry["mig_mode"]["current"]:
        return ["MIG off"]
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in geometry["instances"])


def mutations(agent: AgentProcess) -> int:
    calls = agent.request("GET", "/v1/sim").body["calls"]
    return sum(calls.get(f, 0) for f in MUTATING)


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    running = start_agent(tmp_path / "state")
    yield running
    running.stop(signal.SIGKILL)


def test_h100_off_to_balanced_and_back(agent: AgentProcess) -> None:
    reply = put_mig(agent, "0", {"profiles": BALANCED})
    assert reply.status == 202
    assert reply.body["plan"]["summary"].startswith("enable MIG, keep 0, destroy 0, create 4")
    done = wait_transition(agent, reply.headers["location"])
    assert done["state"] == "succeeded", done
    assert done["steps"][0]["name"] == "enable MIG"
    assert all(s["duration_s"] is not None for s in done["steps"])
    assert layout(agent) == ["1g.10gb@2:1", "1g.10gb@3:1", "2g.20gb@0:2", "3g.40gb@4:4"]
    gpu = agent.request("GET", "/v1/gpus/0", token=None).body
    assert sorted(d["profile"] for d in gpu["mig_devices"]) == sorted(BALANCED)

    before = mutations(agent)
    again = put_mig(agent, "0", {"profiles": list(reversed(BALANCED))})
    assert again.status == 200
    assert again.body["transition"] is None
    assert mutations(agent) == before

    off = put_mig(agent, "0", {"mig_enabled": False})
    assert off.status == 202
    assert wait_transition(agent, off.headers["location"])["state"] == "succeeded"
    assert layout(agent) == ["MIG off"]
    metrics = agent.request("GET", "/metrics", token=None).body
    assert 'gpu_agent_mig_transitions_total{result="succeeded"} 2.0' in metrics
    assert "gpu_agent_mig_instances_destroyed_total 4.0" in metrics


@pytest.mark.parametrize(("body", "status", "text"), [
    ({"profiles": ["3g.40gb", "3g.40gb", "1g.10gb"]}, 422, "no slice is left for 1g.10gb"),
    ({"profiles": ["9g.99gb"]}, 422, "9g.99gb"),
    ({"profiles": ["1g.10gb"], "instances": []}, 422, "not both"),
    ({}, 422, "give profiles, instances or mig_enabled"),
    ({"instances": [{"profile": "2g.20gb", "placement": {"start": 1, "size": 2}}]}, 422,
     "may start only at 0, 2 or 4"),
    ({"profiles": ["1g.10gb"], "drain": {"policy": "later"}}, 422, "drain.policy"),
    ({"profiles": ["1g.10gb"], "drain": {"policy": "wait", "timeout_s": -1}}, 422,
     "drain.timeout_s"),
])
def test_bad_requests_are_4xx_and_change_nothing(agent: AgentProcess, body: dict[str, Any],
                                                 status: int, text: str) -> None:
    reply = put_mig(agent, "0", body)
    assert reply.status == status, reply.body
    assert reply.content_type == "application/problem+json"
    assert text in json.dumps(reply.body)
    assert mutations(agent) == 0
    assert agent.request("GET", "/v1/transitions", token=None).body["transitions"] == []


def test_dry_run_profiles_and_mig_on_l40s(agent: AgentProcess) -> None:
    dry = put_mig(agent, "1", {"profiles": BALANCED}, "?dry_run=true")
    assert dry.status == 200 and dry.body["dry_run"]
    assert len(dry.body["plan"]["create"]) == 4
    assert mutations(agent) == 0
    profiles = agent.request("GET", "/v1/gpus/1/mig/profiles", token=None).body["profiles"]
    by_name = {p["name"]: p for p in profiles}
    assert by_name["3g.40gb"]["placements"] == [{"start": 0, "size": 4}, {"start": 4, "size": 4}]
    assert by_name["1g.10gb"]["free"] == 7
    assert by_name["1g.20gb"]["multiprocessors"] == 26
    reply = put_mig(agent, "1", {"profiles": ["3g.40gb"]})
    wait_transition(agent, reply.headers["location"])
    assert layout(agent, "1") == ["3g.40gb@4:4"]  # placed to leave the most room
    profiles = agent.request("GET", "/v1/gpus/1/mig/profiles", token=None).body["profiles"]
    free = {p["name"]: p["free"] for p in profiles}
    assert (free["1g.10gb"], free["3g.40gb"], free["4g.40gb"], free["7g.80gb"]) == (4, 1, 1, 0)


def test_geometry_needs_the_geometry_scope(agent: AgentProcess) -> None:
    assert put_mig(agent, "0", {"profiles": ["7g.80gb"]}).status == 202
    reply = agent.request("PUT", "/v1/gpus/1/mig", {"profiles": ["7g.80gb"]}, token=None)
    assert reply.status == 401


def test_busy_instance_fail_wait_and_timeout(agent: AgentProcess) -> None:
    wait_transition(agent, put_mig(agent, "0", {"profiles": BALANCED}).headers["location"])
    devices = agent.request("GET", "/v1/gpus/0", token=None).body["mig_devices"]
    three = next(d for d in devices if d["profile"] == "3g.40gb")
    agent.request("POST", "/v1/sim/processes", {"device": three["uuid"], "pid": 4321})
    # A change that keeps the busy 3g goes ahead and the 3g keeps serving.
    keep = put_mig(agent, "0", {"profiles": ["3g.40gb", "1g.20gb", "1g.20gb"]})
    assert wait_transition(agent, keep.headers["location"])["state"] == "succeeded"
    assert "3g.40gb@4:4" in layout(agent)
    # One that must destroy it: 409 under fail, naming the process.
    refused = put_mig(agent, "0", {"profiles": ["7g.80gb"]})
    assert refused.status == 409
    assert "process 4321" in refused.body["detail"]
    # Under wait with a short timeout: aborted, nothing changed.
    before = layout(agent)
    timed = put_mig(agent, "0", {"profiles": ["7g.80gb"],
                                 "drain": {"policy": "wait", "timeout_s": 0.5}})
    assert timed.status == 202
    assert wait_transition(agent, timed.headers["location"])["state"] == "aborted"
    assert layout(agent) == before
    # Under wait: completes once the process is detached.
    waiting = put_mig(agent, "0", {"profiles": ["7g.80gb"],
                                   "drain": {"policy": "wait", "timeout_s": 30}})
    wait_for(lambda: agent.request("GET", waiting.headers["location"], token=None)
             .body["state"] == "draining", "the transition to drain")
    gpu = agent.request("GET", "/v1/gpus/0", token=None).body
    draining = {d["profile"]: d["draining"] for d in gpu["mig_devices"]}
    assert draining["3g.40gb"] is True
    assert agent.request("DELETE", "/v1/sim/processes/4321").status == 204
    assert wait_transition(agent, waiting.headers["location"])["state"] == "succeeded"
    assert layout(agent) == ["7g.80gb@0:8"]


def test_cancel_a_draining_transition(agent: AgentProcess) -> None:
    wait_transition(agent, put_mig(agent, "0", {"profiles": ["7g.80gb"]}).headers["location"])
    device = agent.request("GET", "/v1/gpus/0", token=None).body["mig_devices"][0]
    agent.request("POST", "/v1/sim/processes", {"device": device["uuid"], "pid": 99})
    pending = put_mig(agent, "0", {"mig_enabled": False,
                                   "drain": {"policy": "wait", "timeout_s": 60}})
    busy = put_mig(agent, "0", {"profiles": BALANCED})
    assert busy.status == 409
    tid = pending.body["transition"]["id"]
    cancelled = agent.request("POST", f"/v1/transitions/{tid}/cancel")
    assert cancelled.status == 200
    assert cancelled.body["state"] == "aborted"
    assert layout(agent) == ["7g.80gb@0:8"]


@pytest.mark.parametrize("function", MUTATING)
def test_fault_rolls_back_and_a_second_fault_quarantines(agent: AgentProcess,
                                                         function: str) -> None:
    wait_transition(agent, put_mig(agent, "0", {"instances": [
        {"profile": "3g.40gb", "placement": {"start": 0, "size": 4}},
        {"profile": "1g.10gb", "placement": {"start": 6, "size": 1}}]}).headers["location"])
    old = layout(agent)
    agent.request("POST", "/v1/sim/faults", {"function": function, "error": "NVML_ERROR_UNKNOWN"})
    reply = put_mig(agent, "0", {"profiles": ["2g.20gb", "2g.20gb", "3g.40gb"]})
    done = wait_transition(agent, reply.headers["location"])
    if function == "nvmlDeviceSetMigMode":  # no mode change in this plan: the fault stays armed
        assert done["state"] == "succeeded"
        return
    assert done["state"] == "rolled_back", done
    assert "NVML_ERROR_UNKNOWN" in done["error"]
    assert layout(agent) == old
    # Faults that keep failing the rollback too: failed, GPU quarantined, unhealthy.
    agent.request("DELETE", "/v1/sim/faults")
    agent.request("POST", "/v1/sim/faults", {"function": "nvmlDeviceCreateGpuInstanceWithPlacement",
                                             "error": "NVML_ERROR_UNKNOWN", "times": 100})
    reply = put_mig(agent, "0", {"profiles": ["7g.80gb"]})
    assert wait_transition(agent, reply.headers["location"])["state"] == "failed"
    gpu = agent.request("GET", "/v1/gpus/0", token=None).body
    assert not gpu["health"]["healthy"]
    assert "quarantined" in gpu["health"]["reasons"][-1]
    events = agent.request("GET", "/v1/events", token=None).body["events"]
    assert any(e["kind"] == "mig.quarantined" and "Operator" in e["message"] for e in events)


def apply_ended(agent: AgentProcess, location: str) -> dict[str, Any] | None:
    """The apply at ``location`` once it has stopped running."""
    body: dict[str, Any] = agent.request("GET", location, token=None).body
    return body if body["state"] != "running" else None


def test_standard_mig_parted_configs_apply_on_dgx_h100(agent: AgentProcess) -> None:
    configs = standard_configs(H100_80GB)
    configs["mig-configs"]["custom"] = [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
        {"devices": [2], "mig-enabled": True, "mig-devices": {"1g.20gb": 4}},
        {"devices": [3, 4, 5, 6, 7], "mig-enabled": False}]
    text = yaml.safe_dump(configs)
    for label in ("all-enabled", "all-1g.10gb", "all-2g.20gb", "all-3g.40gb", "all-balanced",
                  "custom", "all-disabled"):
        reply = agent.request("POST", "/v1/mig/apply", {"config": text, "label": label})
        assert reply.status == 202, reply.body
        summary = wait_for(partial(apply_ended, agent, reply.headers["location"]),
                           f"apply {label} to end", 60, every_s=0.05)
        assert summary["state"] == "succeeded", (label, summary)
    assert layout(agent, "0") == ["MIG off"]
    bad = agent.request("POST", "/v1/mig/apply", {"config": text, "label": "nope"})
    assert bad.status == 422 and "all-balanced" in bad.body["detail"]


def test_a100_ordering_trap_succeeds_after_the_reset(tmp_path: Path) -> None:
    reset = "{python} -m agent sim --url unix:{sock} --token-file {tokens} reset {{uuid}}"
    state = tmp_path / "state"
    agent = start_agent(state, preset="dgx-a100", extra=[
        "--gpu-reset-command", reset.format(python=__import__("sys").executable,
                                            sock=state / "agent.sock", tokens=state / "tokens")])
    try:
        trap = {"profiles": ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]}
        assert put_mig(agent, "0", trap).status == 409  # Ampere: mode only when asked
        pending = put_mig(agent, "0", trap | {"mig_enabled": True})
        done = wait_transition(agent, pending.headers["location"])
        assert done["state"] == "pending_reset"
        assert "reset" in done["error"]
        allowed = put_mig(agent, "1", trap | {"mig_enabled": True, "allow_reset": True})
        done = wait_transition(agent, allowed.headers["location"])
        assert done["state"] == "succeeded", done
        assert "reset GPU" in [s["name"] for s in done["steps"]]
        assert len(layout(agent, "1")) == 4
    finally:
        agent.stop()


def _crash_points(tmp_path: Path) -> int:
    """How many mutating NVML calls the crash-test transition makes."""
    agent = start_agent(tmp_path / "count")
    try:
        wait_transition(agent, put_mig(agent, "0", {"profiles": ["7g.80gb"]}).headers["location"])
        before = mutations(agent)
        reply = put_mig(agent, "0", {"profiles": BALANCED})
        wait_transition(agent, reply.headers["location"])
        return mutations(agent) - before
    finally:
        agent.stop(signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_before_any_mutation_rolls_back_to_the_old_geometry(tmp_path: Path) -> None:
    """Killed just before any one of a transition's mutating NVML calls, the agent's next
    start finds the GPU short of the target (the call never acted) and rolls it back: the old
    geometry, the journal empty, the transition rolled_back."""
    points = _crash_points(tmp_path)
    assert points >= 8
    old = ["7g.80gb@0:8"]
    for k in range(points):
        state = tmp_path / f"crash-{k}"
        agent = start_agent(state)
        wait_transition(agent, put_mig(agent, "0", {"profiles": ["7g.80gb"]}).headers["location"])
        agent.request("PUT", "/v1/sim/latency", {f: 0.02 for f in MUTATING})
        # The k-th mutating call of the transition kills the agent (SIGKILL) before it acts.
        function, skip = _kth_mutation(k)
        agent.request("POST", "/v1/sim/faults", {"function": function, "error": "CRASH",
                                                 "skip": skip})
        put_mig(agent, "0", {"profiles": BALANCED})
        assert agent.proc.wait(30) == -signal.SIGKILL
        again = start_agent(state)  # returns once /readyz is ready: recovery is done by then
        try:
            assert layout(again) == old, k
            assert not list((state / "mig" / "journal").glob("*.json"))
            recovered = again.request("GET", "/v1/transitions", token=None).body["transitions"]
            assert [t["state"] for t in recovered[:1]] == ["rolled_back"], (k, recovered)
        finally:
            again.stop(signal.SIGKILL)


_ORDER = ("nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy",
          "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance")


def _kth_mutation(k: int) -> tuple[str, int]:
    """The function and skip count of the k-th mutation of 7g → balanced: one CI destroy, one
    GI destroy, then (GI create, CI create) per new instance."""
    sequence = [_ORDER[0], _ORDER[1]] + [_ORDER[2], _ORDER[3]] * 4
    function = sequence[k]
    return function, sequence[:k].count(function)

