"""Dynamic MIG against a real agent (--dynamic-mig): the first prepare of a published placement
switches a Hopper GPU's MIG on, the unprepare of its last slice switches it off again (unless an
operator switched it on), and an Ampere GPU's mode is never toggled nor its placements
published while MIG is off."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.agent_process import AgentProcess, start_agent

URL = "/v1/resourceslices?kubernetes=1.35"


def _names(agent: AgentProcess, minor: int) -> set[str]:
    body = agent.request("GET", URL).body
    own = f"gpu-{minor}"
    return {d["name"] for s in body["items"] for d in s["spec"].get("devices") or []
            if d["name"] == own or d["name"].startswith(own + "-")}


def _mig(agent: AgentProcess, gpu: int) -> tuple[bool, list[str]]:
    geometry: Any = agent.request("GET", f"/v1/gpus/{gpu}/mig").body
    return geometry["mig_mode"]["current"], sorted(
        f"{i['profile']}@{i['placement']['start']}" for i in geometry["instances"])


def _claim(agent: AgentProcess, uid: str, device: str) -> int:
    return agent.request("PUT", f"/v1/claims/{uid}",
                         {"devices": [{"kind": "slice", "device": device}]}).status


def test_hopper_switches_mig_on_for_the_first_slice_and_off_after_the_last(
        tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state", extra=["--dynamic-mig"])
    try:
        assert _mig(agent, 0) == (False, [])
        before = _names(agent, 0)
        assert {"gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-7g80gb-0-0"} <= before
        assert _claim(agent, "c-1", "gpu-0-mig-1g10gb-19-0") in (200, 201)
        assert _mig(agent, 0) == (True, ["1g.10gb@0"])
        after = _names(agent, 0)
        assert "gpu-0" not in after and "gpu-0-mig-7g80gb-0-0" not in after
        assert "gpu-0-mig-1g10gb-19-0" in after and "gpu-0-mig-1g10gb-19-1" in after
        assert _claim(agent, "c-2", "gpu-0-mig-2g20gb-14-2") in (200, 201)
        assert agent.request("DELETE", "/v1/claims/c-1").status == 204
        assert _mig(agent, 0) == (True, ["2g.20gb@2"])  # another slice is still there
        assert agent.request("DELETE", "/v1/claims/c-2").status == 204
        assert _mig(agent, 0) == (False, [])
        assert _names(agent, 0) == before
    finally:
        agent.stop(signal.SIGKILL)


def test_a_mig_the_operator_switched_on_stays_on(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state", extra=["--dynamic-mig"])
    try:
        reply = agent.request("PUT", "/v1/gpus/1/mig", {"mig_enabled": True, "profiles": []})
        assert reply.status == 202, reply.body
        agent.poll("/v1/gpus/1/mig", lambda body: body["mig_mode"]["current"]
                   and body["active_transition"] is None)
        assert "gpu-1" not in _names(agent, 1)
        assert _claim(agent, "c-1", "gpu-1-mig-1g10gb-19-3") in (200, 201)
        assert agent.request("DELETE", "/v1/claims/c-1").status == 204
        assert _mig(agent, 1) == (True, [])
    finally:
        agent.stop(signal.SIGKILL)


def test_ampere_with_mig_off_publishes_the_gpu_whole_and_never_toggles(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state", preset="dgx-a100", extra=["--dynamic-mig"])
    try:
        assert _mig(agent, 0) == (False, [])
        assert _names(agent, 0) == {"gpu-0"}
        status = _claim(agent, "c-1", "gpu-0-mig-1g5gb-19-0")
        assert status == 409
        assert _mig(agent, 0) == (False, [])
    finally:
        agent.stop(signal.SIGKILL)
