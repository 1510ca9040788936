"""What a real agent process publishes, and the changes tests make to it through its API."""

from __future__ import annotations

from typing import Any

from tests.agent_process import AgentProcess
from tests.waiting import wait_for


def slices_of(agent: AgentProcess, kubernetes: str) -> list[dict[str, Any]]:
    """The agent's ResourceSlices rendered for ``kubernetes`` ("1.34", "1.35", ...)."""
    reply = agent.request("GET", f"/v1/resourceslices?kubernetes={kubernetes}")
    assert reply.status == 200, reply.body
    return list(reply.body["items"])


def set_mig(agent: AgentProcess, gpu: int, profiles: list[str], timeout: float = 60) -> None:
    """Apply a MIG geometry to one GPU (MIG mode on, asked explicitly as Ampere needs) and
    wait for the transition to succeed."""
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig",
                          {"profiles": profiles, "mig_enabled": True})
    assert reply.status in (200, 202), reply.body
    if reply.status == 200:
        return
    def ended() -> dict[str, Any] | None:
        body: dict[str, Any] = agent.request("GET", reply.headers["location"]).body
        return body if body["terminal"] else None
    body = wait_for(ended, f"the MIG transition on GPU {gpu} to end", timeout, every_s=0.05)
    assert body["state"] == "succeeded", body


def gpu_uuid(agent: AgentProcess, index: int) -> str:
    return str(agent.request("GET", f"/v1/gpus/{index}").body["uuid"])
