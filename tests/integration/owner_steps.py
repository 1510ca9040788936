"""Steps shared by the issue-12 integration tests (one owner per GPU): preparing claims,
changing geometry, reading what NVML (the simulator) really holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, Reply
from tests.waiting import wait_for

PROBLEM = "https://gpu.nodeagent.dev/problems/"
MUTATING = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy",
            "nvmlGpuInstanceDestroy")
#: Enough per-call latency to make start-up recovery (journal, claims) take a while.
RECOVERY_LATENCY = {**dict.fromkeys(MUTATING, 0.05), "nvmlDeviceGetGpuInstances": 0.02,
                    "nvmlDeviceGetMigDeviceHandleByIndex": 0.005}


def problem(reply: Reply) -> str:
    """The problem type's short name (``device-busy``), or the status when not a problem."""
    if isinstance(reply.body, dict) and str(reply.body.get("type", "")).startswith(PROBLEM):
        return str(reply.body["type"])[len(PROBLEM):]
    return f"HTTP {reply.status}"


def prepare(agent: AgentProcess, uid: str, *devices: dict[str, Any]) -> Reply:
    return agent.request("PUT", f"/v1/claims/{uid}", {"devices": list(devices)})


def gpu_request(device: str) -> dict[str, Any]:
    return {"kind": "gpu", "device": device}


def slice_request(profile: str = "1g.10gb", gpu: str | None = None) -> dict[str, Any]:
    return {"kind": "slice", "profile": profile, **({"gpu": gpu} if gpu else {})}


def wait_transition(agent: AgentProcess, location: str, timeout: float = 30) -> dict[str, Any]:
    """The transition at ``location`` once it has ended."""
    def ended() -> dict[str, Any] | None:
        body: dict[str, Any] = agent.request("GET", location, token=None).body
        return body if body["terminal"] else None
    return wait_for(ended, f"transition {location} to end", timeout)


def settled_transitions(agent: AgentProcess, timeout: float = 30) -> list[dict[str, Any]]:
    """GET /v1/transitions once every transition is terminal."""
    def settled() -> dict[str, Any] | None:
        body: dict[str, Any] = agent.request("GET", "/v1/transitions", token=None).body
        return body if all(t["terminal"] for t in body["transitions"]) else None
    transitions: list[dict[str, Any]] = wait_for(settled, "every transition to end",
                                                 timeout)["transitions"]
    return transitions


def set_geometry(agent: AgentProcess, gpu: str, body: dict[str, Any]) -> None:
    """Change a GPU's geometry and wait for it to succeed (a no-op when already there)."""
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", body)
    assert reply.status in (200, 202), reply.body
    if reply.status == 202:
        done = wait_transition(agent, reply.headers["location"])
        assert done["state"] == "succeeded", done


def layout(agent: AgentProcess, gpu: str) -> list[str]:
    body = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    if not body["mig_mode"]["current"]:
        return ["MIG off"]
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in body["instances"])


def hardware_mig_uuids(agent: AgentProcess) -> set[str]:
    """Every MIG device UUID that exists in (simulated) NVML right now."""
    return {d["uuid"] for g in agent.request("GET", "/v1/sim").body["gpus"]
            for d in g["mig_devices"]}


def mig_devices(agent: AgentProcess, gpu: str) -> list[dict[str, Any]]:
    return list(agent.request("GET", f"/v1/gpus/{gpu}", token=None).body["mig_devices"])


def claims(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    reply = agent.request("GET", "/v1/claims", token=None)
    assert reply.status == 200, reply.body
    return {c["uid"]: c for c in reply.body["claims"]}


def assert_claims_intact(agent: AgentProcess, before: dict[str, dict[str, Any]]) -> None:
    """Every claim in ``before`` is still prepare_completed with the same devices and its CDI
    spec on disk, and no device is held by two claims."""
    now = claims(agent)
    for uid, claim in before.items():
        assert uid in now, f"claim {uid} was dropped; claims now {sorted(now)}"
        assert now[uid]["state"] == "prepare_completed", now[uid]
        assert [d["uuid"] for d in now[uid]["devices"]] == \
            [d["uuid"] for d in claim["devices"]], now[uid]
        assert now[uid]["cdi_spec"] and Path(now[uid]["cdi_spec"]).exists(), now[uid]
    held = [d["uuid"] for c in now.values() for d in c["devices"]]
    assert len(held) == len(set(held)), f"a device is held twice: {now}"


def wait_readyz(agent: AgentProcess, until: str, timeout: float = 15) -> Reply:
    """/readyz once its reason mentions ``until`` (or it is 200), the agent still running."""
    def answered() -> Reply | None:
        assert agent.proc.poll() is None, f"the agent exited:\n{agent.log()[-2000:]}"
        reply = agent.request("GET", "/readyz", token=None)
        reason = reply.body.get("reason") or "" if isinstance(reply.body, dict) else ""
        return reply if reply.status == 200 or until in reason else None
    return wait_for(answered, f"/readyz to be ready or to mention {until!r}", timeout,
                    every_s=0.05)
