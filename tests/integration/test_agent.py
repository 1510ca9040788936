"""What a user meets: a real ``gpu-agent serve`` process on real sockets."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.api.app import all_routes
from tests.agent_process import AgentProcess, start_agent

PROBLEM = "application/problem+json"


def test_dgx_h100_lists_eight_distinct_h100s(h100: AgentProcess) -> None:
    reply = h100.request("GET", "/v1/gpus", token=None)
    assert reply.status == 200
    gpus = reply.body["gpus"]
    assert [g["name"] for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 8
    assert [g["index"] for g in gpus] == list(range(8))
    assert len({g["uuid"] for g in gpus}) == 8
    assert len({g["pci_bus_id"] for g in gpus}) == 8
    assert {g["memory_total_mib"] for g in gpus} == {81559}
    assert {g["architecture"] for g in gpus} == {"hopper"}
    assert {g["cuda_compute_capability"] for g in gpus} == {"9.0"}
    assert all(g["health"] == {"healthy": True, "reasons": []} for g in gpus)
    assert [g["numa_node"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gpu_by_index_and_by_uuid_agree(h100: AgentProcess) -> None:
    by_index = h100.request("GET", "/v1/gpus/3", token=None).body
    by_uuid = h100.request("GET", f"/v1/gpus/{by_index['uuid']}", token=None).body
    assert by_index == by_uuid
    assert by_index["index"] == 3


@pytest.mark.parametrize("ref", ["8", "GPU-00000000-0000-0000-0000-000000000000", "-1"])
def test_unknown_gpu_is_a_404_problem(h100: AgentProcess, ref: str) -> None:
    reply = h100.request("GET", f"/v1/gpus/{ref}", token=None)
    assert reply.status == 404
    assert reply.content_type == PROBLEM
    assert reply.body["status"] == 404
    assert ref in reply.body["detail"]
    assert reply.body["request_id"] == reply.headers["x-request-id"]


def test_unix_socket_serves_the_same_api_with_mode_0660(h100: AgentProcess) -> None:
    assert stat.S_IMODE(h100.socket_path.stat().st_mode) == 0o660
    over_socket = h100.request("GET", "/v1/node", token=None, unix=True)
    assert over_socket.status == 200
    assert over_socket.body == h100.request("GET", "/v1/node", token=None).body
    node = over_socket.body
    assert node["backend"] == "simulated:dgx-h100"
    assert node["gpu_count"] == 8
    assert node["driver_version"] and node["nvml_version"] and node["cuda_driver_version"]
    boot_id = (h100.state_dir / "proc/sys/kernel/random/boot_id").read_text().strip()
    assert node["boot_id"] == boot_id


def test_mutations_need_a_valid_token(h100: AgentProcess) -> None:
    fault = {"function": "nvmlDeviceGetName", "error": "NVML_ERROR_UNKNOWN", "skip": 10**6}
    missing = h100.request("POST", "/v1/sim/faults", fault, token=None)
    assert missing.status == 401
    assert missing.content_type == PROBLEM
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = h100.request("POST", "/v1/sim/faults", fault, token="not-the-token")
    assert wrong.status == 401
    assert h100.request("GET", "/v1/sim", token=None).body["faults"] == []
    right = h100.request("POST", "/v1/sim/faults", fault)
    assert right.status == 201
    assert h100.request("DELETE", "/v1/sim/faults").status == 204


@pytest.mark.parametrize(("raw", "content_type", "status", "field"), [
    (b"{not json", "application/json", 400, None),
    (b'{"device": "GPU-x", "colour": "red"}', "application/json", 422, "colour"),
    (b'{"device": "GPU-x", "pid": 0}', "application/json", 422, "pid"),
    (b'{"pid": 5}', "application/json", 422, "device"),
    (b"device=GPU-x", "application/x-www-form-urlencoded", 400, None),
])
def test_bad_bodies_are_4xx_problems_naming_the_field(h100: AgentProcess, raw: bytes,
                                                      content_type: str, status: int,
                                                      field: str | None) -> None:
    before = h100.request("GET", "/v1/sim").body["processes"]
    reply = h100.request("POST", "/v1/sim/processes", raw=raw,
                         headers={"Content-Type": content_type})
    assert reply.status == status, reply.body
    assert reply.content_type == PROBLEM
    if field is not None:
        assert [e["field"] for e in reply.body["errors"]] == [field]
        assert field in reply.body["detail"]
    assert h100.request("GET", "/v1/sim").body["processes"] == before


def test_oversized_body_is_413(h100: AgentProcess) -> None:
    reply = h100.request("POST", "/v1/sim/processes", raw=b"x" * (2 << 20),
                         headers={"Content-Type": "application/json"})
    assert reply.status == 413
    assert reply.content_type == PROBLEM


def test_unknown_route_and_method_are_problems(h100: AgentProcess) -> None:
    assert h100.request("GET", "/v1/nothing", token=None).content_type == PROBLEM
    reply = h100.request("DELETE", "/v1/gpus", token=None)
    assert reply.status == 405
    assert reply.content_type == PROBLEM


def test_openapi_lists_every_route(h100: AgentProcess) -> None:
    doc = h100.request("GET", "/openapi.json", token=None).body
    assert doc["openapi"].startswith("3.")
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert listed == {(r.method, r.path) for r in all_routes(simulated=True)}
    gpu_ref = doc["paths"]["/v1/gpus/{gpu}"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["$ref"]
    assert gpu_ref.rsplit("/", 1)[1] in doc["components"]["schemas"]


def test_events_since(h100: AgentProcess) -> None:
    events = h100.request("GET", "/v1/events", token=None).body
    assert any(e["kind"] == "agent.ready" for e in events["events"])
    later = h100.request("GET", f"/v1/events?since={events['last_seq']}", token=None).body
    assert later["events"] == []
    bad = h100.request("GET", "/v1/events?since=abc", token=None)
    assert bad.status == 422
    assert bad.body["errors"][0]["field"] == "since"


def test_metrics_need_no_token(h100: AgentProcess) -> None:
    reply = h100.request("GET", "/metrics", token=None)
    assert reply.status == 200
    assert 'gpu_agent_build_info{backend="simulated:dgx-h100"' in reply.body
    assert "gpu_agent_ready 1.0" in reply.body


def test_xid_79_marks_the_gpu_unhealthy(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state")
    try:
        uuid = agent.request("GET", "/v1/gpus/2", token=None).body["uuid"]
        assert agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 79}).status == 202
        gpu = agent.request("GET", "/v1/gpus/2", token=None).body
        assert gpu["health"]["healthy"] is False
        assert "GPU_IS_LOST" in " ".join(gpu["health"]["reasons"])
        assert agent.request("GET", "/v1/gpus/1", token=None).body["health"]["healthy"] is True
    finally:
        agent.stop(signal.SIGKILL)


@pytest.mark.parametrize(("preset", "expected"), [
    ("dgx-h100", (8, "NVIDIA H100 80GB HBM3", 81559, True)),
    ("dgx-a100", (8, "NVIDIA A100-SXM4-40GB", 40960, True)),
    ("hgx-h200", (8, "NVIDIA H200", 143771, True)),
    ("a100-pcie-bridged", (8, "NVIDIA A100 80GB PCIe", 81920, True)),
    ("l40s", (4, "NVIDIA L40S", 46068, False)),
])
def test_every_preset_starts_and_lists_its_gpus(tmp_path: Path, preset: str,
                                                 expected: tuple[int, str, int, bool]) -> None:
    count, name, memory, mig = expected
    agent = start_agent(tmp_path / "state", preset=preset)
    try:
        gpus = agent.request("GET", "/v1/gpus", token=None).body["gpus"]
        assert [(g["name"], g["memory_total_mib"], g["mig_capable"]) for g in gpus] == \
            [(name, memory, mig)] * count
        assert all((g["mig_mode"] is None) == (not mig) for g in gpus)
        assert agent.request("GET", "/v1/gpus/0", token=None).body == gpus[0]
    finally:
        assert agent.stop() == 0


def test_sigterm_exits_zero_and_removes_listeners(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state")
    assert agent.stop(signal.SIGTERM) == 0
    assert not (agent.state_dir / "listeners.json").exists()
    assert "stopping" in agent.log()


def test_second_agent_on_the_same_state_dir_refuses(tmp_path: Path) -> None:
    first = start_agent(tmp_path / "state")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "agent", "serve", "--simulate", "dgx-h100", "--state-dir",
             str(tmp_path / "state"), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=30, check=False)
        assert second.returncode == 2
        assert f"another gpu-agent (pid {first.proc.pid})" in second.stderr
        assert first.request("GET", "/readyz", token=None).status == 200
    finally:
        first.stop()


def test_not_ready_while_nvml_cannot_initialise_then_ready(tmp_path: Path) -> None:
    faults = [{"function": "nvmlInit", "error": "NVML_ERROR_DRIVER_NOT_LOADED", "times": 2}]
    agent = start_agent(tmp_path / "state", wait_ready=False,
                        env={"GPU_AGENT_SIM_FAULTS": json.dumps(faults)})
    try:
        # Two failed attempts with backoff keep the agent unready for over a second.
        first = agent.request("GET", "/readyz", token=None)
        assert first.status == 503
        assert first.body["status"] == "not ready"
        assert agent.request("GET", "/healthz", token=None).status == 200
        gpus = agent.request("GET", "/v1/gpus", token=None)
        assert gpus.status == 503 and gpus.content_type == PROBLEM
        agent.wait_ready()
        assert "nvml not available" in agent.log()
        assert "NVML_ERROR_DRIVER_NOT_LOADED" in agent.log()
    finally:
        agent.stop()


def test_real_backend_without_a_driver_stays_up_and_unready(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "state", preset=None, wait_ready=False)
    try:
        assert agent.request("GET", "/healthz", token=None).status == 200
        ready = agent.request("GET", "/readyz", token=None)
        assert ready.status == 503
        assert ready.body["reason"]
        # Not simulated: no simulation controls, and no token file means no mutations.
        assert agent.request("GET", "/v1/sim", token=None).status == 404
    finally:
        assert agent.stop() == 0


def test_no_secret_in_the_log(h100: AgentProcess) -> None:
    """The log names who called (audit) and never shows the token, whatever else ran."""
    assert h100.token
    h100.request("GET", "/v1/sim")
    # A mutation of its own (clears no fault: none is set) is audited whatever test ran first.
    assert h100.request("DELETE", "/v1/sim/faults").status == 204
    lines = [line for line in h100.log().splitlines() if "simulated agent token" not in line]
    assert lines
    assert not any(h100.token in line for line in lines)
    assert any("msg=audit" in line and "who=sim" in line for line in lines)  # named, not shown
    assert not any("Warning" in line or "Traceback" in line for line in lines)
